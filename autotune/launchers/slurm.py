"""`--launcher slurm`: the workers as one Slurm job array (`sbatch --array=0-N%K`), each task running
`autotune worker --study S`; followed with `squeue`, stopped with `scancel` (SIGTERM first: each
worker gives its claim back), its tasks' ends read from `sacct` (or `scontrol` where the cluster
keeps no accounting). The job script is written so that a cluster admin can read it (`--dry-run`
prints it and submits nothing). The database URL reaches the tasks in the job's environment (sbatch
exports the submitter's), never in the script, where a password would be on disk and in `ps`.

Every value that reaches the script is checked first against what sbatch accepts for it, where the
flags are read (`--dry-run` included): a partition name, a time limit in sbatch's forms, and each
`--slurm-option` one sbatch option without whitespace, quotes or backslashes, never one the script
sets itself. So no value can end an `#SBATCH` line, add an option to it, or become a shell line
that every array task runs. `sbatch --test-only` then checks the job against the cluster (the
partition exists, the limit is allowed) before the study is written: a cluster that refuses it is
one line, and nothing is left behind."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from autotune.vocabulary.errors import BadInput, quoted
from autotune.launchers.base import Launcher, WorkerEnd, WorkerSpec

COMMAND_SECONDS = 60.0

# What sbatch takes (sbatch(1)): a partition name, or a comma-separated list of them;
PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:,[A-Za-z0-9_.-]{1,64}){0,31}", re.ASCII)
# a time limit: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds, or no limit;
TIME_LIMIT = re.compile(
    r"[0-9]{1,7}(?::[0-9]{1,2}){0,2}|[0-9]{1,5}-[0-9]{1,2}(?::[0-9]{1,2}){0,2}|UNLIMITED|INFINITE", re.ASCII | re.I
)
# one option: --name or --name=value, or -X[value], printable ASCII without whitespace, quotes or a
# backslash (sbatch splits an #SBATCH line at whitespace and reads quotes).
OPTION = re.compile(r"(?:--[A-Za-z][A-Za-z0-9-]*(?:=[!#-&(-\[\]-~]+)?|-[A-Za-z][!#-&(-\[\]-~]*)", re.ASCII)
# Options the script sets itself (the workers' array, names, logs, environment and shape), or that
# would make it another job; --partition and --time have their own flags.
RESERVED = {
    "--job-name": "-J",
    "--array": "-a",
    "--output": "-o",
    "--error": "-e",
    "--export": None,
    "--ntasks": "-n",
    "--wrap": None,
    "--parsable": None,
    "--test-only": None,
    "--partition": "-p",
    "--time": "-t",
    "--gres": None,
    "--cpus-per-task": "-c",
    "--chdir": "-D",
}


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    """The job's own settings: search's --slurm-* flags."""

    partition: str | None = None
    time_limit: str | None = None  # sbatch --time (e.g. 2:00:00)
    parallel: int | None = None  # the array's %K: tasks running at once
    extra: tuple[str, ...] = ()  # more `#SBATCH` lines, as written after it
    output: str = "%x-%A_%a.out"  # each task's log, in the submitting directory (%x: autotune-STUDY)

    def __post_init__(self) -> None:
        if self.partition is not None and not PARTITION.fullmatch(self.partition):
            raise BadInput(
                f"--slurm-partition {quoted(self.partition)} is not a partition name: letters, digits, '_', '.', "
                f"'-' (several joined by commas), e.g. gpu or gpu,debug."
            )
        if self.time_limit is not None and not TIME_LIMIT.fullmatch(self.time_limit):
            raise BadInput(
                f"--slurm-time {quoted(self.time_limit)} is not a time limit sbatch takes: minutes, H:MM:SS, "
                f"D-HH, D-HH:MM:SS or UNLIMITED (e.g. 2:00:00)."
            )
        for option in self.extra:
            check_option(option)


def check_option(option: str) -> None:
    """One --slurm-option: a single sbatch option the script does not set itself."""
    if not OPTION.fullmatch(option):
        raise BadInput(
            f"--slurm-option {quoted(option)}: give one sbatch option per flag, without spaces, quotes or "
            f"backslashes (e.g. --account=ml, --qos=high, --constraint=a100)."
        )
    name = option.split("=", 1)[0] if option.startswith("--") else option[:2]
    for reserved, short in RESERVED.items():
        if name == short or (len(name) >= 3 and reserved.startswith(name)):  # (sbatch takes unique prefixes)
            raise BadInput(
                f"--slurm-option {quoted(option)}: the workers' job script sets {reserved} itself"
                + (f" (give --slurm-{reserved[2:]} instead)" if reserved in ("--partition", "--time") else "")
                + "; leave it out."
            )


def job_name(spec: WorkerSpec) -> str:
    """The workers' job name: the study's, and its tasks' log file names (%x). A new study's name
    is already safe here (store/names.py); one from before that rule is written safe."""
    return "autotune-" + re.sub(r"[^A-Za-z0-9._:@+-]", "_", spec.label)


class SlurmLauncher(Launcher):
    name = "slurm"

    def __init__(self, options: SlurmOptions | None = None) -> None:
        self.options = options or SlurmOptions()
        self.job: str | None = None
        self.job_name = ""  # the submitted script's --job-name (autotune-STUDY): its tasks' log names
        self.count = 0

    # -- the job script --------------------------------------------------------------------------

    def script(self, count: int, spec: WorkerSpec) -> str:
        """The job script: what `--dry-run` prints is what is submitted. Its tasks run this
        interpreter (its path on the nodes: the same environment, on a shared file system or
        installed at the same place)."""
        o = self.options
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={job_name(spec)}",
            f"#SBATCH --array=0-{count - 1}%{o.parallel or count}",
            f"#SBATCH --output={o.output}",
            "#SBATCH --ntasks=1",
            "#SBATCH --export=ALL",
        ]
        if o.partition:
            lines.append(f"#SBATCH --partition={o.partition}")
        if o.time_limit:
            lines.append(f"#SBATCH --time={o.time_limit}")
        if spec.device == "cuda":
            lines.append(f"#SBATCH --gres=gpu:{spec.ranks}")
        else:
            lines.append(f"#SBATCH --cpus-per-task={spec.ranks}")
        lines += [f"#SBATCH {option}" for option in o.extra]
        command = " ".join(shlex.quote(part) for part in [sys.executable, *spec.command()[1:]])
        lines += [
            "",
            "# One autotune worker per array task: it takes probes of the study from the database",
            "# ($AUTOTUNE_DB, exported by sbatch from the search's environment) until the study is done.",
            f"exec {command}",
            "",
        ]
        return "\n".join(lines)

    # -- the seam --------------------------------------------------------------------------------

    def check(self, count: int, spec: WorkerSpec) -> None:
        if shutil.which("sbatch") is None:
            raise BadInput(
                "--launcher slurm: sbatch is not on this machine's PATH; run the search on a Slurm login "
                "node, or use --launcher local or ray."
            )
        self._sbatch(count, spec, "--test-only")

    def start(self, count: int, spec: WorkerSpec) -> None:
        self.count = count
        out = self._sbatch(count, spec, "--parsable")
        self.job = out.strip().split(";")[0]

    def _sbatch(self, count: int, spec: WorkerSpec, mode: str) -> str:
        text = self.script(count, spec)
        self.job_name = job_name(spec)
        # sbatch sends the script's text to slurmctld, which keeps its own copy for the job: this
        # one is gone as soon as sbatch has answered, however it answers.
        folder = Path(tempfile.mkdtemp(prefix="autotune-slurm-"))
        script_path = folder / "worker.sbatch"
        script_path.write_text(text)
        try:
            done = subprocess.run(
                ["sbatch", mode, str(script_path)],
                capture_output=True,
                text=True,
                timeout=COMMAND_SECONDS,
                env={**os.environ, **spec.environment()},
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BadInput(f"--launcher slurm: sbatch did not answer ({exc}); is slurmctld up?") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        said = (done.stderr or "").strip().splitlines()
        if done.returncode != 0:
            why = said[-1].removeprefix("sbatch: error: ") if said else f"exit status {done.returncode}"
            raise BadInput(f"--launcher slurm: sbatch refused the workers' job: {why}; change the --slurm-* flags.")
        return done.stdout

    def alive(self) -> int:
        if self.job is None:
            return 0
        done = self._run("squeue", "-h", "-r", "-j", self.job, "-o", "%i")
        return len([line for line in done.stdout.splitlines() if line.strip()]) if done.returncode == 0 else 0

    def stop(self, grace: float) -> None:
        if self.job is None:
            return
        self._run("scancel", "--signal=TERM", "--full", self.job)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        self._run("scancel", self.job)
        deadline = time.monotonic() + 60
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.5)

    def ends(self) -> list[WorkerEnd]:
        import json

        if self.job is None:
            return []
        states = self.task_states()
        ends = []
        for index in range(self.count):
            name = f"slurm task {self.job}_{index}"
            state = states.get(str(index), "UNKNOWN")
            summary = None
            log = Path(
                self.options.output.replace("%x", self.job_name).replace("%A", self.job).replace("%a", str(index))
            )
            try:
                text = log.read_text()
                summary = json.loads(text[text.index("{") :]) if "{" in text else None
            except (OSError, ValueError):
                summary = None
            if state == "COMPLETED" and summary is not None:
                ends.append(WorkerEnd(name, summary))
            else:
                ends.append(
                    WorkerEnd(name, None, f"{state.lower()}" + ("" if state == "COMPLETED" else f" (its log: {log})"))
                )
        return ends

    def task_states(self) -> dict[str, str]:
        """Each array task's state, as `sacct` says it, else `scontrol` (no accounting kept)."""
        assert self.job is not None
        done = self._run("sacct", "-n", "-P", "-X", "-j", self.job, "--format=JobID,State")
        states: dict[str, str] = {}
        if done.returncode == 0:
            for line in done.stdout.splitlines():
                job, _, state = line.partition("|")
                if "_" in job:
                    states[job.split("_", 1)[1]] = state.split()[0] if state else ""
        if states:
            return states
        done = self._run("scontrol", "show", "job", "-o", self.job)
        for line in done.stdout.splitlines():
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            if "ArrayTaskId" in fields:
                states[fields["ArrayTaskId"]] = fields.get("JobState", "")
        return states

    @staticmethod
    def _run(*command: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess(command, 1, "", str(exc))
