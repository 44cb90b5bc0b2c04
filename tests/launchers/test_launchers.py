"""The launchers' flags and what they refuse without a cluster: a Slurm job script as `--dry-run`
prints it (and nothing written), no sbatch, no Ray cluster, another launcher's flags."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys

import pytest

from autotune.vocabulary.errors import BadInput
from autotune.launchers.base import WorkerSpec
from autotune.launchers.choose import make_launcher
from autotune.launchers.slurm import SlurmLauncher, SlurmOptions
from tests.helpers.cli import invoke


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m autotune ARGS` in a process of its own: for the Ray launcher's refusal, which
    imports Ray (seconds, and its state left in whatever process imported it)."""
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
    # The Slurm commands in this process (`invoke`): the printed script and the one-line refusals
    # are the subject, not a second interpreter's start.
    printed = invoke(
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
        done = invoke(
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


# What reached the job script unchecked before (2026-12-01): a newline became a shell line every
# array task ran, a space another sbatch option, and --dry-run printed it all.
HOSTILE_SLURM = [
    ({"slurm_partition": "gpu\ntouch /tmp/pwned"}, "--slurm-partition 'gpu\\ntouch /tmp/pwned' is not a partition"),
    ({"slurm_partition": "gpu --wrap=id"}, "--slurm-partition 'gpu --wrap=id' is not a partition"),
    ({"slurm_time": "2:00:00\nrm -rf ~"}, "--slurm-time '2:00:00\\nrm -rf ~' is not a time limit"),
    ({"slurm_time": "2 hours"}, "--slurm-time '2 hours' is not a time limit"),
    ({"slurm_options": ("--account=ml\ntouch /tmp/pwned",)}, "give one sbatch option per flag"),
    ({"slurm_options": ("--account=ml --qos=high",)}, "give one sbatch option per flag"),
    ({"slurm_options": ('--comment="a b"',)}, "without spaces, quotes or backslashes"),
    ({"slurm_options": ("--array=0-999",)}, "the workers' job script sets --array itself"),
    ({"slurm_options": ("--exp=NONE",)}, "sets --export itself"),  # (sbatch takes a unique prefix)
    ({"slurm_options": ("-o/etc/cron.d/x",)}, "sets --output itself"),
    ({"slurm_options": ("--partition=debug",)}, "sets --partition itself (give --slurm-partition instead)"),
]


@pytest.mark.parametrize(("flags", "needle"), HOSTILE_SLURM, ids=[needle[:40] for _, needle in HOSTILE_SLURM])
def test_a_value_that_would_change_the_job_script_is_refused_where_the_flags_are_read(flags, needle):
    with pytest.raises(BadInput, match=re.escape(needle)):
        make_launcher("slurm", workers=2, dry_run=True, **flags)


def test_values_sbatch_takes_reach_the_script_one_line_each():
    options = SlurmOptions(
        partition="gpu,debug",
        time_limit="1-12:00:00",
        extra=("--account=ml", "--exclude=node[01-03]", "--constraint=a100&nvlink", "-Aml", "--mem=64G"),
    )
    script = SlurmLauncher(options).script(2, WorkerSpec("old study é", "", "cuda"))
    lines = script.splitlines()
    assert "#SBATCH --partition=gpu,debug" in lines and "#SBATCH --time=1-12:00:00" in lines
    assert "#SBATCH --exclude=node[01-03]" in lines and "#SBATCH -Aml" in lines
    # A name from before study names were checked is written safe; a log is not autotune-autotune-...
    assert "#SBATCH --job-name=autotune-old_study__" in lines and "#SBATCH --output=%x-%A_%a.out" in lines
    assert sum(line.startswith("exec ") for line in lines) == 1


@pytest.mark.slow  # (the command line itself)
def test_a_hostile_slurm_value_is_one_line_before_anything_on_dry_run_and_serve(tmp_path, tiny_model):
    db = tmp_path / "hostile.db"
    for command in (
        ["search", "--model", tiny_model, "--gpu-budget", "1GiB", "--device", "cpu", "--dry-run"],
        ["serve", "--port", "18081", "--workers", "1"],
    ):
        done = invoke(*command, "--launcher", "slurm", "--slurm-partition", "gpu\necho pwned", "--db", str(db))
        assert done.returncode == 2 and done.stdout == "", done.stdout
        assert done.stderr.strip().splitlines() == [
            "autotune: error: --slurm-partition 'gpu\\necho pwned' is not a partition name: letters, digits, "
            "'_', '.', '-' (several joined by commas), e.g. gpu or gpu,debug."
        ]
        assert not db.exists()


def test_an_address_that_is_not_a_ray_head_is_one_line_at_once():
    """ray.init waited minutes on a port that answers TCP but is not a head's GCS (the dashboard's
    8265 is the common mistake), and a Ray Client address ended in a traceback."""
    import http.server
    import threading
    import time

    from autotune.launchers.ray_cluster import ray_address

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        with pytest.raises(BadInput, match="something answers there, but not a Ray head"):
            ray_address(f"127.0.0.1:{server.server_address[1]}")
        assert time.monotonic() - started < 10
    finally:
        server.shutdown()
    with pytest.raises(BadInput, match="that is a Ray Client address"):
        ray_address("ray://10.0.0.1:10001")


def test_dry_run_of_a_finished_study_says_the_search_would_submit_nothing(tmp_path, tiny_model, hermetic_home):
    """It printed a job script the real command would never submit (that command answers from the
    database); the database is only read."""
    import dataclasses

    from autotune.flags.flag import parse, reading_command
    from autotune.flags.table import SEARCH
    from autotune.search.request import resolve_search
    from autotune.search.request_flags import read_search_flags
    from autotune.store import open_store
    from tests.helpers.cli import invoke
    from tests.helpers.store import ENV, FakeModel

    args = ["--model", tiny_model, "--gpu-budget", "1GiB", "--micro-batches", "1,2", "--block-sizes", "32"]
    flags = read_search_flags(parse(reading_command("search", SEARCH), args))
    settings = dataclasses.replace(flags.settings, device="cuda")  # (as the dry run reads auto: the nodes')
    request = resolve_search(flags.model, flags.budget, settings=settings, options=flags.options, **flags.space_args)
    db = tmp_path / "finished.db"
    with open_store(db) as store:
        study = store.get_or_create_study(
            request.name,
            model=FakeModel(tiny_model),
            environment=ENV,
            budget_bytes=request.budget.total_bytes,
            margin_bytes=request.budget.margin_bytes,
            effective_batch=request.space.work_per_step,
            space=request.space.to_dict(),
        )
        store.set_study_status(study.id, "finished")
    before = db.read_bytes()
    done = invoke("search", *args, "--launcher", "slurm", "--dry-run", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "answers from the database and submits no job" in done.stderr
    assert db.read_bytes() == before
    fresh = invoke("search", *args, "--launcher", "slurm", "--dry-run", "--fresh", "--db", str(db))
    assert fresh.returncode == 0 and fresh.stdout.startswith("#!/bin/bash\n"), fresh.stderr
