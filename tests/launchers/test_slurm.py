"""`--launcher slurm` on a real Slurm controller and node on this machine (tests/launchers/
slurm_cluster.py: munged, slurmctld, slurmd; skipped, saying why, where Debian's slurmctld, slurmd,
slurm-client and munge are absent or not root): a tiny CPU search with two array tasks finishes with
a pick and the tasks ended; the search SIGTERMed leaves no task queued or running; a partition the
cluster refuses is one line and nothing written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from autotune.store import open_store
from tests.helpers.faults import fault_env
from tests.helpers.models import write_model_dir
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}


def search(cluster, tmp_path, *extra: str, fault: str | None = None) -> subprocess.Popen:
    """The search on the cluster, two array tasks; with `fault`, every probe of its workers
    misbehaves so (tests/helpers/faults: sbatch exports the search's environment to the tasks)."""
    model = write_model_dir(tmp_path / "tiny", **TINY)
    command = [
        sys.executable,
        "-m",
        "autotune",
        "search",
        "--model",
        str(model),
        "--gpu-budget",
        "200MiB",
        "--device",
        "cpu",
        "--micro-batches",
        "1,2,4",
        "--effective-batch",
        "4",
        "--block-sizes",
        "32",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off,on",
        "--attention",
        "sdpa",
        "--measure-seconds",
        "0.3",
        "--warmup-steps",
        "2",
        "--measure-steps",
        "2",
        "--no-predict",
        "--no-confirm",
        "--json",
        "--db",
        str(tmp_path / "slurm.db"),
        "--launcher",
        "slurm",
        "--workers",
        "2",
        "--slurm-partition",
        cluster.partition,
        "--heartbeat",
        "1",
        *extra,
    ]
    temporary = tmp_path / "tmp"  # (the search's own temporary directory: what it leaves there is seen)
    temporary.mkdir(exist_ok=True)
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={
            **(fault_env(fault, cluster.env) if fault else cluster.env),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(temporary),
        },
        start_new_session=True,
    )


def jobs_named(cluster, study: str) -> list[str]:
    listed = cluster.run("scontrol", "show", "job", "-o", check=False).stdout
    return sorted(
        {
            fields["ArrayJobId"]
            for line in listed.splitlines()
            if (fields := dict(p.split("=", 1) for p in line.split() if "=" in p)).get("JobName") == f"autotune-{study}"
            and "ArrayJobId" in fields
        }
    )


def test_two_array_tasks_search_to_a_pick_and_end(slurm_cluster, tmp_path):  # noqa: F811
    run = search(slurm_cluster, tmp_path)
    out, err = run.communicate(timeout=400)
    assert run.returncode == 0, err[-3000:] + slurm_cluster.logs_tail()
    summary = json.loads(out)
    assert summary["status"] == "finished" and summary["best"] is not None and summary["workers"] == 2
    assert summary["failures"] == [] if "failures" in summary else True
    [job] = jobs_named(slurm_cluster, "tiny-200MiB")
    assert set(slurm_cluster.wait_states(job, 2).values()) == {"COMPLETED"}
    assert slurm_cluster.queued(job) == []
    with open_store(tmp_path / "slurm.db") as store:
        assert store.study("tiny-200MiB").status == "finished"
        assert len({p.worker for p in store.probes("tiny-200MiB") if p.result.status != "skipped"}) >= 1
    assert sorted(p.name for p in tmp_path.glob(f"autotune-tiny-200MiB-{job}_*.out")) == [
        f"autotune-tiny-200MiB-{job}_0.out",
        f"autotune-tiny-200MiB-{job}_1.out",
    ]
    # The job script went to slurmctld with the submission: no copy of it is left behind.
    assert list((tmp_path / "tmp").glob("autotune-slurm-*")) == []


def test_sigterm_cancels_the_array_and_a_refused_partition_writes_nothing(slurm_cluster, tmp_path):  # noqa: F811
    # Every probe hangs in its first timed step: the SIGTERM comes while the tasks probe, whatever
    # the machine's speed.
    run = search(slurm_cluster, tmp_path, "--study", "term", fault="hang")
    deadline, probing = time.monotonic() + 240, False
    while not probing and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.5)
        try:
            with open_store(tmp_path / "slurm.db") as store:
                probing = any(
                    c.state == "running" for c in store.claims.of_study(store.study("term").id, stale_after=3)
                )
        except Exception:
            continue
    assert probing, run.stderr.read() if run.poll() is not None else "no probe started"
    [job] = jobs_named(slurm_cluster, "term")
    os.killpg(run.pid, signal.SIGTERM)
    run.communicate(timeout=120)
    assert run.returncode == 143
    slurm_cluster.wait_gone(job, timeout=60)
    assert slurm_cluster.queued(job) == []
    # Each task's worker was stopped by the SIGTERM scancel sent (exit 143: FAILED to Slurm), or
    # cancelled before it ran: none is left pending or running.
    assert set(slurm_cluster.wait_states(job, 2).values()) <= {"CANCELLED", "FAILED", "COMPLETED"}
    # A partition the cluster does not have: sbatch --test-only refuses it before anything is written.
    refused = search(
        slurm_cluster,
        tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path,
        "--slurm-partition",
        "no-such-partition",
    )
    out, err = refused.communicate(timeout=120)
    assert refused.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "sbatch refused the workers' job" in lines[0] and "partition" in lines[0].lower()
    assert not (tmp_path / "x" / "slurm.db").exists()
