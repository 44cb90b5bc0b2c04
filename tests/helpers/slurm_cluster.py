"""A real single-machine Slurm cluster for a test: munged, slurmctld and slurmd on loopback.

Use it by importing the fixture into a test module (it is module-scoped: one cluster per module)::

    from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (a pytest fixture)

    @pytest.mark.slow
    def test_something(slurm_cluster):
        out = slurm_cluster.run("sbatch", "--parsable", "--wrap", "true").stdout

Everything lives in one temporary directory under /tmp: its own munge key, munge socket, slurm.conf,
state, spool, logs and pid files. Nothing under /etc is read for the cluster's settings or written
(client commands find the config through SLURM_CONF, the daemons through `-f`; munge is pointed at
its own key and socket, and slurm.conf's AuthInfo=socket=... sends every Slurm command there). The
ports are free ones picked at start, so a system Slurm, or a second cluster from another pytest
worker, does not collide with it.

Accounting: Debian's Slurm 22.05 has no accounting_storage/filetxt any more (only none, slurmdbd
and mysql), so plain `sacct` needs slurmdbd ("Slurm accounting storage is disabled"). It does have
jobcomp/filetxt, and this cluster configures it: `sacct --completion` (`-c`) reads the job-completion
file; it knows no array tasks, see `sacct_states`.
`job_states` asks `scontrol show job` (finished jobs stay there for MinJobAge seconds, 3600 here)
and falls back to the completion file.

Needs root (the daemons run as SlurmUser=root) and Debian's `slurmctld slurmd slurm-client munge`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers.ports import free_port
from tests.helpers.processes import kill_marked

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "sacct")
PARTITION = "debug"
MIN_JOB_AGE = 3600  # seconds a finished job stays visible to `scontrol show job` / `squeue --states=all`
START_TIMEOUT = 60.0
# Set in the daemons' and the clients' environment (so in every job's too: sbatch exports the
# submitter's environment by default). Teardown finds leftover job steps by it.
MARKER = "AUTOTUNE_TEST_SLURM_CLUSTER"
# Prefixes of variables that would steer Slurm's client commands (set when pytest itself runs
# inside a Slurm job, or by a user's shell): the cluster's env drops them.
_CLIENT_VARS = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SACCT_", "SCANCEL_", "SCONTROL_")
# Final states as scontrol/sacct print them, normalised ("CANCELLED by 0" -> "CANCELLED").
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


def slurm_unavailable() -> str | None:
    """Why a real Slurm cluster cannot be started here, or None where it can."""
    if not sys.platform.startswith("linux"):
        return f"a local Slurm cluster needs Linux (this is {sys.platform})"
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        return (
            f"Slurm/munge binaries not found: {', '.join(missing)} "
            "(apt-get install slurmctld slurmd slurm-client munge)"
        )
    if os.geteuid() != 0:
        return "a local Slurm cluster runs its daemons as SlurmUser=root: the tests must run as root"
    if not Path("/tmp").is_dir():
        return "no /tmp for the cluster's directory (munge wants every directory above its socket searchable)"
    return None


def _expand_task_ids(spec: str) -> list[str]:
    """'0-3%2' / '1,4-5' / '7' -> the task ids, as strings."""
    spec = spec.split("%", 1)[0]
    ids: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            first, _, rest = part.partition("-")
            last, _, step = rest.partition(":")
            ids.extend(str(i) for i in range(int(first), int(last) + 1, int(step or 1)))
        else:
            ids.append(part)
    return ids


def _key_values(line: str) -> dict[str, str]:
    """'JobId=4 JobState=COMPLETED ...' (scontrol --oneliner, the jobcomp file) -> a dict."""
    return {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}


def _normal_state(state: str) -> str:
    return state.split()[0].rstrip("+") if state.strip() else state


@dataclass
class SlurmCluster:
    """A running cluster. `env` is what client commands need (SLURM_CONF and no stray SLURM_*)."""

    root: Path
    conf: Path
    env: dict[str, str]
    node: str
    jobcomp_log: Path
    log_dir: Path
    partition: str = PARTITION
    startup_seconds: float = 0.0  # from starting munged to the node idle in sinfo
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, squeue, sbatch, scancel, scontrol, sacct...) against this
        cluster; text output. With check, a non-zero exit raises with the command's stderr."""
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def sbatch(self, *args: str) -> str:
        """Submit with `sbatch --parsable` into this cluster's partition; the job id."""
        out = self.run("sbatch", "--parsable", f"--partition={self.partition}", *args).stdout.strip()
        return out.split(";", 1)[0]

    def queued(self, job_id: str | int) -> list[str]:
        """`squeue` lines (id state) of the job's tasks still pending or running."""
        proc = self.run("squeue", "--noheader", "--array", "--jobs", str(job_id), "--format=%i %T", check=False)
        if proc.returncode != 0:  # squeue exits 1 for a job id it no longer knows
            return []
        return [line.strip() for line in proc.stdout.splitlines() if line.strip()]

    def wait_gone(self, job_id: str | int, timeout: float = 60) -> None:
        """Wait until squeue no longer lists any task of the job."""
        deadline = time.monotonic() + timeout
        while self.queued(job_id):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still queued after {timeout:.0f}s: {self.queued(job_id)}\n{self.logs_tail()}"
                )
            time.sleep(0.5)

    def scontrol_states(self, job_id: str | int) -> dict[str, str]:
        """From `scontrol show job`: array task id -> state (the job id itself for a job that is not an
        array). Finished jobs stay visible for MinJobAge seconds; pending tasks still folded into one
        record (ArrayTaskId=2-5%2) are expanded."""
        proc = self.run("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
        if proc.returncode != 0:
            return {}
        states: dict[str, str] = {}
        for line in proc.stdout.splitlines():
            fields = _key_values(line)
            if "JobState" not in fields:
                continue
            state = _normal_state(fields["JobState"])
            if "ArrayTaskId" in fields:
                for task in _expand_task_ids(fields["ArrayTaskId"]):
                    states[task] = state
            else:
                states[fields.get("JobId", str(job_id))] = state
        return states

    def completion_records(self) -> list[dict[str, str]]:
        """The job-completion file (jobcomp/filetxt), one dict per ended job or array task: JobId,
        JobState, ArrayJobId, ArrayTaskId, ExitCode, StartTime, EndTime..."""
        try:
            text = self.jobcomp_log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [_key_values(line) for line in text.splitlines() if line]

    def sacct_states(self, job_id: str | int) -> dict[str, str]:
        """From `sacct --completion` (jobcomp/filetxt, no slurmdbd): array task id -> final state, only
        for tasks that have ended (the job id itself for a job that is not an array).

        Slurm 22.05's `sacct -c` is not array-aware: each task shows under its own raw job id (task 0
        of array 1 may be job 2), `-j <array id>` finds only the task that kept the array's id, and
        it prints "Unknown type ArrayJobId" on stderr. So sacct gives the states by raw id and the
        completion file's ArrayJobId/ArrayTaskId map them to tasks."""
        job_id = str(job_id)
        proc = self.run(
            "sacct", "--completion", "--noheader", "--parsable2", "--allusers", "--format=JobIDRaw,State", check=False
        )
        if proc.returncode != 0:
            return {}
        by_raw = {}
        for line in proc.stdout.splitlines():
            raw, _, state = line.partition("|")
            if state:
                by_raw[raw] = _normal_state(state)
        states: dict[str, str] = {}
        for record in self.completion_records():
            raw = record.get("JobId")
            if raw not in by_raw:
                continue
            if record.get("ArrayJobId") == job_id and "ArrayTaskId" in record:
                states[record["ArrayTaskId"]] = by_raw[raw]
            elif raw == job_id and "ArrayJobId" not in record:
                states[job_id] = by_raw[raw]
        return states

    def job_states(self, job_id: str | int) -> dict[str, str]:
        """Array task id -> state (COMPLETED, CANCELLED, FAILED, TIMEOUT..., or RUNNING/PENDING while
        not finished); for a job that is not an array, one entry keyed by the job id. scontrol's
        view, completed by the job-completion file for tasks scontrol has forgotten."""
        states = self.sacct_states(job_id)
        states.update(self.scontrol_states(job_id))
        return states

    def wait_states(self, job_id: str | int, count: int, timeout: float = 60) -> dict[str, str]:
        """Wait until `count` tasks of the job are in a final state; job_states then."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.job_states(job_id)
            if sum(state in TERMINAL_STATES for state in states.values()) >= count:
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {states} after {timeout:.0f}s\n{self.logs_tail()}")
            time.sleep(0.5)

    def logs_tail(self, lines: int = 30) -> str:
        """The last lines of every daemon log, for an assertion message."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            try:
                text = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def _client_env(root: Path, conf: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(_CLIENT_VARS)}
    env["SLURM_CONF"] = str(conf)
    env[MARKER] = str(root)
    return env


def _write_config(root: Path, node: str, munge_socket: Path) -> tuple[Path, Path]:
    etc, state, spool, logs = root / "etc", root / "state", root / "spool", root / "log"
    for path in (etc, state, spool, logs):
        path.mkdir()
    jobcomp = logs / "jobcomp.txt"
    conf = etc / "slurm.conf"
    conf.write_text(f"""\
# Written by tests/helpers/slurm_cluster.py for one test module; removed after it.
ClusterName=autotune-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={logs}/slurmctld.pid
SlurmdPidFile={logs}/slurmd.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups anywhere: processes tracked through /proc, no task binding, no usage gathering.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# No slurmdbd: no accounting storage; finished jobs go to a text file `sacct --completion` reads.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={jobcomp}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# The node is what this file says, whatever the hardware (or the sandbox) reports.
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge={MIN_JOB_AGE}
KillWait=5
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs=2 RealMemory=1024 State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    return conf, jobcomp


def _stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _start(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    with open(log_dir / f"{name}.out", "wb") as out:
        return subprocess.Popen(
            args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        for name, daemon in cluster._procs.items():
            if daemon.poll() is not None:
                raise RuntimeError(f"{name} exited with {daemon.returncode} while the cluster started")
        proc = cluster.run("sinfo", "--noheader", "--nodes", cluster.node, "--format=%T", check=False, timeout=20)
        last = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0 and last == "idle":
            return
        time.sleep(0.25)
    raise RuntimeError(f"node {cluster.node} not idle after {timeout:.0f}s (sinfo: {last!r})")


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd on this machine for the module; yield a SlurmCluster; stop
    them all (and any job still running) and remove the directory after. Skips where
    slurm_unavailable() says why; fails, with the daemons' logs, where the cluster does not start."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with local_slurm_cluster() as cluster:
            yield cluster
    except ClusterStartError as exc:
        pytest.fail(str(exc))


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message carries the daemons' logs."""


@contextlib.contextmanager
def local_slurm_cluster(start_timeout: float = START_TIMEOUT) -> Iterator[SlurmCluster]:
    """The fixture's body, usable outside pytest: start the cluster, yield it, tear it down.
    Raises ClusterStartError (after cleaning up) where it does not start."""
    # Directly under /tmp and 0755: munged refuses a socket in a directory that not everyone can
    # search (pytest's own tmp directories are 0700), and a socket path must stay short.
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    root.chmod(0o755)
    node = socket.gethostname().split(".")[0]
    key_dir, munge_dir, munge_state = root / "munge-key", root / "munge", root / "munge-state"
    key_dir.mkdir(mode=0o700)
    munge_dir.mkdir(mode=0o755)
    munge_state.mkdir(mode=0o700)
    key = key_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = munge_dir / "munge.socket"
    conf, jobcomp = _write_config(root, node, munge_socket)
    env = _client_env(root, conf)
    cluster = SlurmCluster(root=root, conf=conf, env=env, node=node, jobcomp_log=jobcomp, log_dir=root / "log")
    started = time.monotonic()
    try:
        cluster._procs["munged"] = _start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={munge_socket}",
                f"--pid-file={munge_state / 'munged.pid'}",
                f"--seed-file={munge_state / 'munged.seed'}",
                f"--log-file={cluster.log_dir / 'munged.log'}",
            ],
            env,
            cluster.log_dir,
        )
        deadline = time.monotonic() + 15
        while not munge_socket.exists():
            if cluster._procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not create its socket")
            time.sleep(0.05)
        cluster._procs["slurmctld"] = _start("slurmctld", ["slurmctld", "-D", "-f", str(conf)], env, cluster.log_dir)
        cluster._procs["slurmd"] = _start("slurmd", ["slurmd", "-D", "-f", str(conf), "-N", node], env, cluster.log_dir)
        _wait_idle(cluster, start_timeout)
    except Exception as exc:
        logs = cluster.logs_tail() + "".join(
            f"\n--- {out.name}\n{out.read_text(errors='replace')[-3000:]}" for out in cluster.log_dir.glob("*.out")
        )
        _teardown(cluster)
        raise ClusterStartError(f"could not start a local Slurm cluster: {exc}\n{logs}") from exc
    cluster.startup_seconds = time.monotonic() - started
    try:
        yield cluster
    finally:
        _teardown(cluster)


def _teardown(cluster: SlurmCluster) -> None:
    try:
        ctld = cluster._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            # Cancel what is left, so that slurmd ends the jobs' steps itself.
            cluster.run("scancel", "--full", "--user=root", check=False, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                left = cluster.run("squeue", "--noheader", "--format=%i", check=False, timeout=20)
                if left.returncode != 0 or not left.stdout.strip():
                    break
                time.sleep(0.5)
    except (OSError, subprocess.SubprocessError):
        pass
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster._procs.get(name)
        if proc is not None:
            _stop(proc)
    # slurmstepd outlives a SIGTERM for long when its slurmd is gone (it keeps trying to reach it).
    kill_marked(MARKER, str(cluster.root))  # a slurmstepd or job process that outlived its slurmd
    shutil.rmtree(cluster.root, ignore_errors=True)
