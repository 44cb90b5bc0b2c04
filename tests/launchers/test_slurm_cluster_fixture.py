"""The local Slurm cluster fixture (tests/helpers/slurm_cluster.py) really runs jobs: a two-task
array runs on this machine and both tasks end COMPLETED; a long job scancelled ends CANCELLED and
leaves the queue; teardown leaves no daemon behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.processes import marked_pids
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def test_array_runs_and_long_job_cancels(slurm_cluster, tmp_path):  # noqa: F811
    cluster = slurm_cluster
    assert cluster.run("sinfo", "--noheader", "--format=%P %T").stdout.split() == [f"{cluster.partition}*", "idle"]

    out = tmp_path / "out"
    out.mkdir()
    array = cluster.sbatch(
        "--array=0-1%2",
        f"--output={out}/slurm-%A_%a.out",
        f"--chdir={tmp_path}",
        "--wrap",
        f"sleep 2; echo $SLURM_ARRAY_TASK_ID > {out}/task-$SLURM_ARRAY_TASK_ID",
    )
    assert array.isdigit()
    deadline = time.monotonic() + 60
    seen_running = False
    while lines := cluster.queued(array):
        seen_running |= any(line.endswith("RUNNING") for line in lines)
        assert time.monotonic() < deadline, f"array {array} still queued: {lines}\n{cluster.logs_tail()}"
        time.sleep(0.3)
    assert seen_running
    for task in ("0", "1"):
        assert (out / f"task-{task}").read_text().strip() == task
    assert cluster.job_states(array) == {"0": "COMPLETED", "1": "COMPLETED"}
    # The same from the job-completion file: `sacct --completion`, no slurmdbd.
    assert cluster.wait_states(array, 2) == {"0": "COMPLETED", "1": "COMPLETED"}
    assert cluster.sacct_states(array) == {"0": "COMPLETED", "1": "COMPLETED"}

    long = cluster.sbatch(f"--output={out}/long-%j.out", "--wrap", "sleep 300")
    deadline = time.monotonic() + 30
    while cluster.job_states(long).get(long) != "RUNNING":
        assert time.monotonic() < deadline, f"job {long}: {cluster.job_states(long)}\n{cluster.logs_tail()}"
        time.sleep(0.3)
    cluster.run("scancel", long)
    cluster.wait_gone(long, timeout=30)
    assert cluster.wait_states(long, 1, timeout=30) == {long: "CANCELLED"}
    assert cluster.sacct_states(long) == {long: "CANCELLED"}
    assert long not in cluster.run("squeue", "--noheader", "--format=%i").stdout.split()


def test_teardown_leaves_nothing_running(tmp_path):
    """Run the fixture's generator through (start, then teardown) and check its daemons and directory
    are gone."""
    from tests.helpers import slurm_cluster as module

    if reason := module.slurm_unavailable():
        pytest.skip(reason)
    with module.local_slurm_cluster() as cluster:
        pids = [proc.pid for proc in cluster._procs.values()]
        assert len(pids) == 3
        job = cluster.sbatch("--wrap", "sleep 300", f"--output={tmp_path}/left-%j.out")  # left for teardown
        deadline = time.monotonic() + 30
        while cluster.job_states(job).get(job) != "RUNNING":
            assert time.monotonic() < deadline, cluster.job_states(job)
            time.sleep(0.3)
        assert marked_pids(module.MARKER, str(cluster.root))  # the job's slurmstepd and sleep carry the marker
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"daemon {pid} still there"
    assert marked_pids(module.MARKER, str(cluster.root)) == []
    assert not cluster.root.exists()
