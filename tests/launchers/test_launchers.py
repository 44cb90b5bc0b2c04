"""The launchers' flags and what they refuse without a cluster: a Slurm job script as `--dry-run`
prints it (and nothing written), no sbatch, no Ray cluster, another launcher's flags."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import pytest

from autotune.vocabulary.errors import BadInput
from autotune.launchers.base import WorkerSpec
from autotune.launchers.choose import make_launcher
from autotune.launchers.slurm import SlurmLauncher, SlurmOptions


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_the_slurm_script_says_the_array_the_resources_and_no_secret():
    launcher = SlurmLauncher(SlurmOptions(partition="gpu", time_limit="2:00:00", parallel=2, extra=("--account=ml",)))
    spec = WorkerSpec("gpt2-8GiB", "postgresql+psycopg://u:secret@db/autotune", "cuda", ranks=2, timeout=600.0)
    script = launcher.script(4, spec)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert {
        "#SBATCH --array=0-3%2",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2:00:00",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --account=ml",
        "#SBATCH --export=ALL",
    } <= set(lines)
    # (the search's own interpreter, as submitted: what --dry-run prints is what runs)
    assert lines[-1] == (
        f"exec {shlex.quote(sys.executable)} -m autotune worker --study gpt2-8GiB --device cuda "
        f"--json --timeout 600.000s"
    )
    assert "secret" not in script and "postgresql" not in script
    cpu = SlurmLauncher().script(1, WorkerSpec("s", "", "cpu", ranks=2))
    assert "#SBATCH --cpus-per-task=2" in cpu and "--gres" not in cpu and "--partition" not in cpu


def test_flags_of_another_launcher_are_refused():
    with pytest.raises(BadInput, match="--slurm-partition is for the Slurm launcher"):
        make_launcher("ray", workers=2, slurm_partition="gpu")
    with pytest.raises(BadInput, match="--dry-run is for the Slurm launcher"):
        make_launcher("local", workers=2, dry_run=True)
    with pytest.raises(BadInput, match="--ray-address is for the Ray launcher"):
        make_launcher("slurm", workers=2, ray_address="h:1")
    assert make_launcher("local", workers=2) is None


@pytest.mark.slow  # (the command line itself)
def test_dry_run_prints_the_script_and_writes_nothing_and_a_missing_cluster_is_one_line(tmp_path, tiny_model):
    db = tmp_path / "dry.db"
    printed = run(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "1GiB",
        "--device",
        "cpu",
        "--launcher",
        "slurm",
        "--workers",
        "3",
        "--slurm-parallel",
        "2",
        "--dry-run",
        "--db",
        str(db),
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("#!/bin/bash\n") and "#SBATCH --array=0-2%2" in printed.stdout
    assert not db.exists()
    if shutil.which("sbatch") is None:
        done = run(
            "search",
            "--model",
            tiny_model,
            "--gpu-budget",
            "1GiB",
            "--device",
            "cpu",
            "--launcher",
            "slurm",
            "--db",
            str(db),
        )
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [
            "autotune: error: --launcher slurm: sbatch is not on this machine's PATH; run the search on a Slurm login "
            "node, or use --launcher local or ray."
        ]
        assert not db.exists()
    done = run(
        "search",
        "--model",
        tiny_model,
        "--gpu-budget",
        "1GiB",
        "--device",
        "cpu",
        "--launcher",
        "ray",
        "--ray-address",
        "127.0.0.1:9",
        "--db",
        str(db),
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "no Ray cluster answers there" in done.stderr or "needs Ray" in done.stderr
    assert not db.exists()
