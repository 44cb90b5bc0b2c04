"""Every CUDA claim of autotune measured on a real card, into one JSON, under a wall-clock deadline.

    python -m benchmarks.gpu_evidence --out DIR [--state DIR] [--deadline SECONDS] [--sections a,b,...] [--cpu]

Sections run in order (SECTIONS below); the JSON (`DIR/gpu-evidence.json`) is rewritten after each
one, so a command killed midway keeps what it finished. A section already `measured` or `skipped`
in `--state` is not run again; a failed one is retried; one the deadline did not reach (or cut
short) stays `pending` and the same command goes on with it. Exit status: 0 every selected section
done, 3 some pending, 1 some failed, 2 a mistake in the command or no CUDA without --cpu.

`--cpu` runs the same sections on a tiny GPT-2 with MiB budgets, CUDA-only ones skipped, so that
the script is known to work before device minutes are spent on it (tests/benchmarks/test_gpu_evidence.py).
On the GPU machine: benchmarks/gpu_evidence.sh and docs/gpu-evidence.md.

The orchestrator never imports torch: everything that touches torch or the card runs in a child
process (a section's command, or one of the HELPERS below through `Run.helper`), in its own process
group, killed with its children when the deadline arrives.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, NoReturn

from autotune.environment import cpu_name, package_version
from autotune.speed import ALLOC_CONF_VARS, allocator_environment
from autotune.version import __version__
from benchmarks.estimator_vs_probe import TINYLLAMA_1_1B
from benchmarks.run import TINY_GPT2, Deadline

REPO = Path(__file__).resolve().parent.parent
EVIDENCE_FILE = "gpu-evidence.json"
LOG_FILE = "gpu-evidence.log"
STATE_TAR = "gpu-evidence-state.tar.gz"
RESULT_MARK = "GPU_EVIDENCE_RESULT "
EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_PENDING = 0, 1, 2, 3
# A child told to stop (SIGTERM: autotune marks its study interrupted) gets this long before SIGKILL.
KILL_GRACE_SECONDS = 10.0
# What a command that ends itself (search --timeout, benchmarks.run --deadline) is told to leave
# free before our deadline: its own wrap-up, and our kill's grace.
WRAP_UP_SECONDS = 45.0
MiB, GiB = 2**20, 2**30
# google/pegasus-large's shape (568M parameters), and a tiny one of the same family for the CPU mode.
PEGASUS_SHAPED = {
    "model_type": "pegasus",
    "architectures": ["PegasusForConditionalGeneration"],
    "vocab_size": 96103,
    "max_position_embeddings": 1024,
    "d_model": 1024,
    "encoder_layers": 16,
    "decoder_layers": 16,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 4096,
    "decoder_ffn_dim": 4096,
    "is_encoder_decoder": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "scale_embedding": True,
}
TINY_PEGASUS = {
    **PEGASUS_SHAPED,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
# The public reference the forum config is held against (the forum report the README starts from:
# gpt2 under Trainer's defaults peaking at 8-9 GiB).
FORUM_PEAK_ALLOCATED_GIB, FORUM_PEAK_RESERVED_GIB = 8.06, 8.73
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "tokenizers",
    "optuna",
    "sqlalchemy",
    "alembic",
    "datasets",
    "peft",
    "bitsandbytes",
    "liger_kernel",
    "pynvml",
)
IMAGE_VERSIONS = (
    "import importlib.metadata as m, json\n"
    "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
    "print(json.dumps({n: v(n) for n in ('pyarrow', 'datasets', 'pandas', 'torch', 'transformers')}))"
)
# Kept out of the state's tarball: a full model checkpoint of the training run, caches, scratch.
NOT_TARRED = ("train-run", "handoff-run", "cache", "tmp")
MAX_TARRED_FILE_BYTES = 8 * MiB


class SectionEnd(Exception):
    """How a section ends other than measured: the message is the status's reason; `figures` what
    it measured on the way (kept, and read back by the next attempt)."""

    prefix = ""

    def __init__(self, reason: str, figures: Mapping[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = dict(figures or {})

    @property
    def status(self) -> str:
        return f"{self.prefix}: {one_line(str(self))}"


class Skip(SectionEnd):
    prefix = "skipped"


class Pending(SectionEnd):
    prefix = "pending"


class Failed(SectionEnd):
    prefix = "failed"


class Interrupted(BaseException):
    """SIGTERM: stop now, as if the deadline had come (a BaseException, as KeyboardInterrupt is, so
    that no section's error handling records it as the section's failure)."""


class UsageError(Exception):
    """A mistake in the command: one line, exit status 2, nothing written."""


def one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return one_line(lines[-1] if lines else "", limit)


def is_done(status: str | None) -> bool:
    return bool(status) and (status == "measured" or str(status).startswith("skipped"))


# -- running children -------------------------------------------------------------------------------


@dataclass
class Outcome:
    """A finished child: its exit status (None when it had to be killed), stdout, wall time, and
    whether the deadline (`cut`) or its own timeout (`timed_out`) ended it."""

    argv: list[str]
    returncode: int | None
    stdout: str
    seconds: float
    cut: bool = False
    timed_out: bool = False

    def json(self, accept: Sequence[int] = (0,), what: str = "") -> dict:
        """Its stdout as one JSON object; Pending when the deadline cut it, Failed otherwise."""
        what = what or Path(self.argv[2] if len(self.argv) > 2 else self.argv[0]).name
        if self.cut:
            raise Pending(f"{what} was stopped at the deadline; the same command goes on")
        if self.timed_out or self.returncode not in accept:
            status = "timed out" if self.timed_out else f"exit status {self.returncode}"
            raise Failed(f"{what}: {status}: {last_line(self.stdout) or 'see the log'}")
        try:
            data = json.loads(self.stdout)
        except json.JSONDecodeError:
            raise Failed(f"{what}: no JSON on stdout: {last_line(self.stdout)!r}") from None
        if not isinstance(data, dict):
            raise Failed(f"{what}: stdout is not a JSON object")
        return data


def kill_group(process: subprocess.Popen) -> None:
    """End `process` and everything it started (its process group): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            if sig == signal.SIGTERM:
                # The leader is gone; a child that ignored SIGTERM must not outlive it.
                os.killpg(process.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(
    argv: Sequence[str],
    *,
    log: IO[str],
    scratch: Path,
    deadline: Deadline,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> Outcome:
    """Run `argv` from the repository root in a process group of its own (not a session of its own:
    the GPU machine ends leftover processes of a command, except those in a new session), stderr
    straight into `log` as it comes, stdout into a file then the log. Killed, with its group, at
    the deadline or after `timeout` seconds; its group is ended afterwards anyway, so nothing it
    started is left running."""
    argv = [str(a) for a in argv]
    log.write(f"\n$ {shlex.join(argv)}\n")
    log.flush()
    scratch.mkdir(parents=True, exist_ok=True)
    out_path = scratch / f"stdout-{os.getpid()}-{time.monotonic_ns()}.txt"
    started = time.monotonic()
    left = deadline.left()
    limits = [t for t in (timeout, left) if t is not None]
    limit = min(limits) if limits else None
    cut = timed_out = False
    with open(out_path, "w+") as out:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=dict(env) if env is not None else None,
            stdout=out,
            stderr=log,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            cut = left is not None and (timeout is None or left <= timeout)
            timed_out = not cut
        finally:
            kill_group(process)
        out.seek(0)
        stdout = out.read()
    out_path.unlink(missing_ok=True)
    seconds = time.monotonic() - started
    returncode = None if cut or timed_out else process.returncode
    if stdout:
        log.write(f"--- stdout ---\n{stdout}{'' if stdout.endswith(chr(10)) else chr(10)}")
    ending = "stopped at the deadline" if cut else "timed out" if timed_out else f"exit status {returncode}"
    log.write(f"--- {ending}, {seconds:.1f} s ---\n")
    log.flush()
    return Outcome(argv, returncode, stdout, seconds, cut, timed_out)


# -- a run: where things go, the deadline, the document ------------------------------------------------


@dataclass
class Run:
    """One invocation: its directories, mode, deadline, log, and the evidence document it writes."""

    out: Path
    state: Path
    mode: str  # "cuda" or "cpu"
    deadline: Deadline
    log: IO[str]
    doc: dict
    python: str = sys.executable

    @property
    def cuda(self) -> bool:
        return self.mode == "cuda"

    @property
    def sections(self) -> dict[str, dict]:
        return self.doc["sections"]

    def previous(self, name: str) -> dict:
        """What an earlier attempt of section `name` left (pending or failed ones included)."""
        return dict(self.sections.get(name) or {})

    def say(self, line: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S")
        self.log.write(f"[{stamp}] {line}\n")
        self.log.flush()
        print(line, file=sys.stderr, flush=True)

    def env(self, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The children's environment: autotune's files and the HF caches inside the state, no hub,
        this repository importable; `overrides` set (None: unset) what a child needs besides."""
        env = dict(os.environ)
        home = self.state / "home"
        env.update(
            {
                "AUTOTUNE_HOME": str(home),
                "AUTOTUNE_DB": f"sqlite:///{home / 'autotune.db'}",
                "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_CACHE": str(self.state / "cache" / "hf-datasets"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            }
        )
        if not self.cuda:
            # Two cores: one OpenMP thread per process, or children spin against each other.
            env.setdefault("OMP_NUM_THREADS", "1")
        for name, value in (overrides or {}).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def command(
        self, argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str | None] | None = None
    ) -> Outcome:
        return run_child(
            argv, log=self.log, scratch=self.state / "tmp", deadline=self.deadline, timeout=timeout, env=self.env(env)
        )

    def autotune(self, *args: str, timeout: float | None = None) -> Outcome:
        return self.command([self.python, "-m", "autotune", *args], timeout=timeout)

    def helper(
        self, name: str, *, timeout: float = 300.0, env: Mapping[str, str | None] | None = None, **kwargs: Any
    ) -> dict:
        """Run HELPERS[name](**kwargs) in a fresh Python process; its figures."""
        code = "import sys; from benchmarks.gpu_evidence import helper_main; helper_main(sys.argv[1:])"
        outcome = self.command([self.python, "-c", code, name, json.dumps(kwargs)], timeout=timeout, env=env)
        if outcome.cut:
            raise Pending(f"{name} was stopped at the deadline")
        lines = [line for line in outcome.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if outcome.timed_out or not lines:
            why = (
                f"timed out after {timeout:.0f} s"
                if outcome.timed_out
                else f"exit status {outcome.returncode}, no result"
            )
            raise Failed(f"{name}: {why} (see {LOG_FILE})")
        return json.loads(lines[-1][len(RESULT_MARK) :])

    def timeout_flag(self, flag: str, unit: str = "") -> list[str]:
        """`flag SECONDS` for a command that ends itself before our deadline (none without one)."""
        left = self.deadline.left()
        if left is None:
            return []
        return [flag, f"{max(30, int(left - WRAP_UP_SECONDS))}{unit}"]

    def db(self, name: str) -> str:
        return f"sqlite:///{self.state / name}"

    @property
    def tiny_model(self) -> Path:
        return self.state / "tiny-gpt2"

    def save(self) -> None:
        """The document into --out and --state (written whole, then renamed: a kill leaves the
        previous one), and, where they differ, the state packed into --out so that a fresh machine
        can be given it back (docs/gpu-evidence.md)."""
        self.doc["updated"] = utc_now()
        text = json.dumps(self.doc, indent=1, default=str) + "\n"
        for directory in dict.fromkeys([self.out, self.state]):
            tmp = directory / f".{EVIDENCE_FILE}.tmp"
            tmp.write_text(text)
            os.replace(tmp, directory / EVIDENCE_FILE)
        if self.out.resolve() != self.state.resolve():
            pack_state(self.state, self.out / STATE_TAR)


def pack_state(state: Path, target: Path) -> None:
    """The state directory as a tarball (its model checkpoints, caches and scratch left out)."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(part in NOT_TARRED for part in parts[1:]) or info.name.endswith(".tmp"):
            return None
        if info.isfile() and info.size > MAX_TARRED_FILE_BYTES:
            return None
        return info

    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(state, arcname=state.name, filter=keep)
    os.replace(tmp, target)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- sections -----------------------------------------------------------------------------------------


def section_versions(run: Run) -> dict:
    """Versions of what the evidence depends on, and what nvidia-smi says about the card."""
    # On CPU an import says nothing about CUDA libraries and costs 7 s of the CPU mode's minute
    # (peft, bitsandbytes): there the versions come from the installed metadata.
    figures: dict[str, Any] = {"packages": run.helper("versions", timeout=180, packages=list(PACKAGES), load=run.cuda)}
    # The machine's own versions of what the carried wheels may shadow (datasets 5 needs pyarrow >= 24):
    # whether the next session must carry them.
    image = run.command([run.python, "-c", IMAGE_VERSIONS], timeout=60, env={"PYTHONPATH": None})
    figures["image_packages"] = (
        json.loads(image.stdout.strip().splitlines()[-1])
        if image.returncode == 0
        else {"error": last_line(image.stdout)}
    )
    if shutil.which("nvidia-smi") is None:
        figures["nvidia_smi"] = "skipped: nvidia-smi not found"
    else:
        query = run.command(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
            timeout=60,
        )
        full = run.command(["nvidia-smi"], timeout=60)
        figures["nvidia_smi"] = {
            "query": query.stdout.strip(),
            "output": full.stdout.strip(),
            "exit_status": full.returncode,
        }
    return figures


# Each micro-check: a name, what it runs, and the seconds it needs at least (it is not started with less).
MicroCheck = tuple[str, Callable[["Run"], dict], float]


def check_cap_oom(allocator: str) -> Callable[[Run], dict]:
    def check(run: Run) -> dict:
        return run.helper("cap_oom", timeout=120, env=allocator_environment(allocator))

    return check


def check_allocator_var_priority(run: Run) -> dict:
    """Which of the two variables torch reads when both are set, each way round, with the two
    single-variable cases as controls that the detection itself works."""
    cases: dict[str, dict[str, str | None]] = {
        "alloc_false_cuda_true": {
            "PYTORCH_ALLOC_CONF": "expandable_segments:False",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        },
        "alloc_true_cuda_false": {
            "PYTORCH_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
        },
        "cuda_true_only": {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        "neither": {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None},
    }
    results = {name: run.helper("allocator_settings", timeout=120, env=env) for name, env in cases.items()}
    a, b = results["alloc_false_cuda_true"]["expandable"], results["alloc_true_cuda_false"]["expandable"]
    controls_ok = results["cuda_true_only"]["expandable"] is True and results["neither"]["expandable"] is False
    winner = (
        "PYTORCH_ALLOC_CONF"
        if (a, b) == (False, True)
        else "PYTORCH_CUDA_ALLOC_CONF"
        if (a, b) == (True, False)
        else "neither consistently"
    )
    return {
        "cases": results,
        "winner": winner,
        "detection_controls_ok": controls_ok,
        "autotune_assumes": ALLOC_CONF_VARS[0],
    }


def check_handoff_compile(run: Run) -> dict:
    """The hand-off's TrainingArguments for a compiled fp32 winner, 2 Trainer steps of a tiny model;
    and the same without `tf32`, which is what transformers would do without the hand-off's word."""
    out = run.state / "tmp" / "handoff"
    return {
        "handoff": run.helper(
            "handoff_compile",
            timeout=420,
            model_dir=str(run.tiny_model),
            output_dir=str(out / "with-tf32"),
            drop_tf32=False,
        ),
        "without_tf32_key": run.helper(
            "handoff_compile",
            timeout=420,
            model_dir=str(run.tiny_model),
            output_dir=str(out / "without-tf32"),
            drop_tf32=True,
        ),
    }


def check_bitsandbytes_import(run: Run) -> dict:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed (../shared/gpu/wheels.sh bitsandbytes==0.50.2)")
    return run.helper("bitsandbytes_import", timeout=120)


# The CUDA facts the estimator's constants rest on (pass 1): the cap raising OOM, the context, cuBLAS.
CUDA_FACTS: tuple[MicroCheck, ...] = (
    ("cap_oom_default", check_cap_oom("default"), 30),
    ("cap_oom_expandable", check_cap_oom("expandable"), 30),
    ("context_after_step", lambda run: run.helper("context_after_step", timeout=180), 60),
    ("cublas_workspace", lambda run: run.helper("cublas_workspace", timeout=120), 30),
)
# The other facts autotune took from reading torch's and transformers' sources, checked on the card.
MICRO_CHECKS: tuple[MicroCheck, ...] = (
    ("context_with_other_process", lambda run: run.helper("context_with_other_process", timeout=180), 60),
    ("device_assert_then_mem_get_info", lambda run: run.helper("device_assert", timeout=120), 30),
    ("allocator_var_priority", check_allocator_var_priority, 90),
    ("bitsandbytes_import", check_bitsandbytes_import, 30),
    ("tf32_compile_handoff", check_handoff_compile, 240),
)


def run_checks(run: Run, section: str, listed: Sequence[MicroCheck]) -> dict:
    """Each check in a process of its own; one already measured by an earlier attempt is kept, a
    failed one tried again."""
    earlier = run.previous(section).get("checks", {})
    checks: dict[str, dict] = {}
    for name, check, needs in listed:
        if is_done(earlier.get(name, {}).get("status")):
            checks[name] = earlier[name]
            continue
        left = run.deadline.left()
        if left is not None and left < needs:
            checks[name] = {"status": f"pending: {left:.0f} s left of the {needs:.0f} it needs"}
            continue
        started = time.monotonic()
        try:
            figures, status = check(run), "measured"
        except SectionEnd as end:
            figures, status = end.figures, end.status
        except Exception as exc:  # an answer the check did not expect: this check fails, the others go on
            run.log.write(traceback.format_exc())
            figures, status = {}, f"failed: {type(exc).__name__}: {one_line(str(exc))}"
        checks[name] = {"status": status, "seconds": round(time.monotonic() - started, 1), **figures}
        run.say(f"  {section}.{name}: {status}")
        if status.startswith("pending"):
            break
    failed = [name for name, c in checks.items() if c["status"].startswith("failed")]
    pending = [name for name, c in checks.items() if c["status"].startswith("pending")]
    figures = {"checks": checks}
    if failed:
        raise Failed(f"checks {', '.join(failed)} failed (the next run tries them again)", figures)
    if pending or len(checks) < len(listed):
        raise Pending(f"checks {', '.join(pending) or 'left'} not reached", figures)
    return figures


def section_cuda_facts(run: Run) -> dict:
    return run_checks(run, "cuda_facts", CUDA_FACTS)


def section_micro_checks(run: Run) -> dict:
    return run_checks(run, "micro_checks", MICRO_CHECKS)


def gpu_test_files() -> list[str]:
    """The test files that carry the gpu mark: collecting only these is 0.5 s on CPU against 7 s for
    the whole suite, where every GPU test skips anyway."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for number, word in PYTEST_COUNT.findall(text):
        key = "error" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


def node_outcome(outcome: Outcome) -> dict:
    """One GPU test's result from its pytest run's output."""
    counts = pytest_counts("\n".join(outcome.stdout.splitlines()[-5:]))
    result: dict[str, Any] = {"seconds": round(outcome.seconds, 1)}
    if outcome.returncode not in (0, 1):
        result["outcome"] = "error"
    elif counts.get("failed") or counts.get("error"):
        result["outcome"] = "failed"
    elif counts.get("passed"):
        result["outcome"] = "passed"
    elif counts.get("skipped"):
        result["outcome"] = "skipped"
    else:
        result["outcome"] = "unknown"
    if result["outcome"] in ("failed", "error", "unknown"):
        summary = [line for line in outcome.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
        result["message"] = one_line(summary[0] if summary else last_line(outcome.stdout), 500)
    return result


def section_pytest_gpu(run: Run) -> dict:
    """`pytest -m gpu`, one test per pytest run, so that a deadline costs only the test in flight
    and the next run goes on from there. Every test runs even after one fails (unlike -x): each is
    its own evidence, and a rerun would otherwise repeat the failure to reach the others."""
    base = [run.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    # A test module that cannot be imported here (a dev-only package the GPU image lacks) must not
    # hide the GPU tests of the others.
    collect = [
        run.python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "--collect-only",
        "--continue-on-collection-errors",
    ]
    # On a card the whole suite is collected (a GPU test outside the files that say so would be
    # missed otherwise); on CPU only the files with the mark, to keep the CPU mode short.
    paths = [] if run.cuda else gpu_test_files()
    # Without a card every GPU test only says why it skips: one verbose pytest process collects and
    # runs them all (each in its own would start Python, torch and transformers a dozen times over
    # for nothing, and a separate collection once more).
    collected = run.command([*collect, *paths], timeout=300) if run.cuda else cpu_mode_run(run, paths)
    if collected.cut:
        raise Pending("collection was stopped at the deadline")
    nodes = collected_nodes(collected.stdout, verbose=not run.cuda)
    if not nodes:
        raise Failed(f"pytest -m gpu collected no test: {last_line(collected.stdout)}")
    earlier = run.previous("pytest_gpu").get("tests", {})
    tests: dict[str, dict] = {} if run.cuda else cpu_mode_outcomes(collected, nodes)
    for node in nodes:
        if node in tests:
            continue
        before = earlier.get(node, {})
        if before.get("outcome") in ("passed", "failed", "skipped", "error"):
            tests[node] = before
            continue
        left = run.deadline.left()
        if left is not None and left < 60:
            break
        outcome = run.command([*base, node], timeout=900)
        if outcome.cut:
            cuts = before.get("cut_by_deadline", 0) + 1
            # A test longer than a whole call never ends: say so after the second cut.
            tests[node] = (
                {"outcome": "error", "message": "stopped at the deadline twice: longer than one call"}
                if cuts >= 2
                else {"outcome": "cut", "cut_by_deadline": cuts}
            )
            break
        tests[node] = node_outcome(outcome)
        run.say(f"  {node}: {tests[node]['outcome']}")
    counts: dict[str, int] = {}
    for result in tests.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    unimportable = [
        line.split()[1] for line in collected.stdout.splitlines() if line.startswith("ERROR ") and len(line.split()) > 1
    ]
    figures = {
        "collected": len(nodes),
        "counts": counts,
        "tests": tests,
        "modules_not_collected": unimportable,
        "command": shlex.join(["python", *base[1:]]) + " NODE (each)",
    }
    if len(tests) < len(nodes) or counts.get("cut"):
        raise Pending(f"{len(nodes) - len(tests) + counts.get('cut', 0)} tests not run before the deadline", figures)
    return figures


PYTEST_VERBOSE_LINE = re.compile(r"^(\S+::.*?) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)\b")


def collected_nodes(stdout: str, verbose: bool) -> list[str]:
    """The test ids a pytest run named: `--collect-only -q` prints one per line; `-v` one per line
    followed by its outcome (and the summary's `FAILED NODE - why` lines, which are not read)."""
    if verbose:
        return [found.group(1) for line in stdout.splitlines() if (found := PYTEST_VERBOSE_LINE.match(line))]
    return [line.strip() for line in stdout.splitlines() if "::" in line and not line.startswith(" ")]


def cpu_mode_run(run: Run, paths: list[str]) -> Outcome:
    """One verbose pytest run of the GPU tests in `paths`: `NODE SKIPPED (reason)` per line."""
    return run.command([run.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *paths], timeout=900)


def cpu_mode_outcomes(outcome: Outcome, nodes: list[str]) -> dict[str, dict]:
    """The GPU tests' outcomes from cpu_mode_run's output; a node it does not name is left for the
    one-per-run loop."""
    found: dict[str, dict] = {}
    for node in nodes:
        line = next((line for line in outcome.stdout.splitlines() if line.startswith(node + " ")), "")
        word = line[len(node) + 1 :].split(" ", 1)[0].lower() if line else ""
        if word in ("passed", "skipped", "failed", "error"):
            found[node] = {"outcome": word, "seconds": round(outcome.seconds / len(nodes), 1)}
            if word in ("failed", "error"):
                found[node]["message"] = one_line(line, 500)
    return found


def readme_search_args(run: Run) -> list[str]:
    """The README's command: gpt2 under 8 GiB; on CPU a tiny GPT-2 under 12 MiB, a two-config space,
    without the memory prediction (its trace child is 5 s of the CPU mode's minute; estimator_vs_probe
    runs the estimator anyway)."""
    if run.cuda:
        return ["--model", "gpt2", "--gpu-budget", "8GiB"]
    return [
        "--model",
        str(run.tiny_model),
        "--gpu-budget",
        "12MiB",
        "--device",
        "cpu",
        "--no-predict",
        "--micro-batches",
        "1,2",
        "--effective-batch",
        "2",
        "--block-sizes",
        "64",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--measure-seconds",
        "0.2",
    ]


def search_figures(summary: dict, outcome: Outcome, earlier: dict) -> dict:
    """What a `search --json` said, its wall time added to the earlier attempts' (a search the
    deadline cut short resumes from its database)."""
    best = summary.get("best") or {}
    return {
        "exit_status": outcome.returncode,
        "study": summary.get("study"),
        "study_status": summary.get("status"),
        "stop_reason": summary.get("stop_reason"),
        "candidates": summary.get("candidates"),
        "probes": summary.get("probed"),
        "reused": summary.get("reused"),
        "skipped": summary.get("skipped"),
        "unmeasured": summary.get("unmeasured"),
        "confirmation": summary.get("confirmation"),
        "attempts": earlier.get("attempts", 0) + 1,
        "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
        "search_seconds": round(earlier.get("search_seconds", 0.0) + float(summary.get("seconds") or 0.0), 1),
        "pick": {
            key: best.get(key)
            for key in (
                "label",
                "tokens_per_s",
                "step_seconds",
                "peak_allocated_bytes",
                "peak_reserved_bytes",
                "context_bytes",
                "mfu",
                "phase_peaks",
                "eval_batch_found",
            )
        }
        if best
        else None,
        "leaderboard": [
            {key: row.get(key) for key in ("label", "tokens_per_s", "peak_reserved_bytes", "context_bytes")}
            for row in summary.get("leaderboard", [])
        ],
    }


def run_search(run: Run, earlier: dict, args: list[str], db: str) -> dict:
    """One `autotune search --json` that resumes across calls (`earlier`: what the last attempts
    recorded): Pending while the deadline cuts it."""
    # Said by the first attempt: a search resumed from its own database is still the one from empty.
    empty = earlier.get("database_was_empty", not Path(db.removeprefix("sqlite:///")).exists())
    argv = ["search", *args, "--db", db, "--json", *run.timeout_flag("--timeout", "s")]
    outcome = run.autotune(*argv)
    if outcome.cut:
        raise Pending(
            "the search was stopped at the deadline; the same command goes on",
            {
                **earlier,
                "database_was_empty": empty,
                "attempts": earlier.get("attempts", 0) + 1,
                "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
            },
        )
    summary = outcome.json(accept=(0, 1, 3), what="autotune search")
    figures = {
        "database_was_empty": empty,
        "command": "autotune " + shlex.join(argv),
        **search_figures(summary, outcome, earlier),
    }
    if summary.get("stop_reason") in ("timeout", "interrupted"):
        raise Pending("the search stopped at its --timeout; the same command goes on", figures)
    figures["probes_stored"] = run.helper("study_probes", timeout=120, db=db)["probes"]
    return figures


def section_readme_command(run: Run) -> dict:
    """The README's search from an empty database, then `autotune best --format json`."""
    db = run.db("readme.db")
    figures = run_search(run, run.previous("readme_command"), readme_search_args(run), db)
    best = run.autotune("best", "--db", db, "--format", "json", timeout=120)
    figures["best"] = best.json(what="autotune best") if best.returncode == 0 else {"exit_status": best.returncode}
    return figures


def forum_probes(run: Run) -> dict[str, list[str]]:
    """The forum user's config (Trainer defaults) on the whole card and under 8 GiB; on CPU the same
    levers on the tiny model at block 128, under 1 GiB (room) and 12 MiB (too little)."""
    if run.cuda:
        model, block, device = "gpt2", "512", "cuda"
        budgets = {"whole_card": str(run.doc["device_total_bytes"]), "budget_8GiB": "8GiB"}
        extra: list[str] = []
    else:
        model, block, device = str(run.tiny_model), "128", "cpu"
        budgets = {"whole_card": "1GiB", "budget_8GiB": "12MiB"}
        extra = ["--measure-seconds", "0.2"]
    config = [
        "--model",
        model,
        "--micro-batch",
        "8",
        "--block-size",
        block,
        "--precision",
        "fp32",
        "--attention",
        "sdpa",
        "--optimizer",
        "adamw",
        "--no-checkpointing",
        "--device",
        device,
        *extra,
    ]
    return {name: ["probe", *config, "--gpu-budget", budget, "--json"] for name, budget in budgets.items()}


def section_forum_config(run: Run) -> dict:
    """gpt2, micro-batch 8, block 512, fp32, sdpa, AdamW, no checkpointing: the whole card (the
    user measured 8.06 GiB allocated, 8.73 GiB reserved), and under 8 GiB (expected: oom)."""
    earlier = run.previous("forum_config").get("probes", {})
    probes: dict[str, dict] = {}
    for name, argv in forum_probes(run).items():
        if name in earlier:
            probes[name] = earlier[name]
            continue
        try:
            # Exit 1 is a measurement too: the config does not fit.
            result = run.autotune(*argv, timeout=900).json(accept=(0, 1), what=f"autotune probe ({name})")
        except SectionEnd as end:
            end.figures = {"probes": probes}  # the probe that finished is kept for the next attempt
            raise
        probes[name] = {
            "command": "autotune " + shlex.join(argv),
            "status": result.get("status"),
            **{
                k: result.get(k)
                for k in (
                    "peak_allocated_bytes",
                    "peak_reserved_bytes",
                    "context_bytes",
                    "budget_bytes",
                    "margin_bytes",
                    "cap_bytes",
                    "tokens_per_s",
                    "step_seconds",
                    "wall_seconds",
                )
            },
            "error": one_line(result.get("error") or "") or None,
        }
    whole = probes["whole_card"]
    figures: dict[str, Any] = {
        "probes": probes,
        "small_budget_ooms_as_expected": probes["budget_8GiB"]["status"] == "oom",
    }
    if run.cuda and whole.get("peak_allocated_bytes"):
        figures["vs_forum"] = {
            "forum_peak_allocated_gib": FORUM_PEAK_ALLOCATED_GIB,
            "forum_peak_reserved_gib": FORUM_PEAK_RESERVED_GIB,
            "peak_allocated_ratio": round(whole["peak_allocated_bytes"] / GiB / FORUM_PEAK_ALLOCATED_GIB, 3),
            "peak_reserved_ratio": round((whole.get("peak_reserved_bytes") or 0) / GiB / FORUM_PEAK_RESERVED_GIB, 3),
        }
    return figures


def benchmark_args(run: Run) -> list[str]:
    if run.cuda:
        return ["--models", "gpt2"]
    # benchmarks.run's tiny case, cut to two configs and the two phases that give its figures.
    return [
        "--device",
        "cpu",
        "--models",
        "tiny:12MiB",
        "--micro-batches",
        "1,2",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--effective-batch",
        "2",
        "--phases",
        "ground-truth,search",
        "--no-estimate",
    ]


def benchmark_summary(doc: dict) -> dict:
    cases = []
    for case in doc.get("cases", []):
        search, truth = case.get("autotune") or {}, case.get("ground_truth") or {}
        cases.append(
            {
                "model": case.get("model"),
                "budget_bytes": case.get("budget_bytes"),
                "candidates": case.get("candidates"),
                "figures": case.get("figures"),
                "pending": case.get("pending"),
                "search_pick": (search.get("pick") or {}).get("label"),
                "search_probes": search.get("probed"),
                "search_gpu_seconds": search.get("gpu_seconds"),
                "ground_truth_probes": truth.get("probed"),
                "ground_truth_gpu_seconds": truth.get("gpu_seconds"),
                "alternatives": [
                    {k: a.get(k) for k in ("name", "status", "probed")} | {"pick": (a.get("pick") or {}).get("label")}
                    for a in case.get("alternatives") or []
                ],
            }
        )
    return {"device": doc.get("device"), "date": doc.get("date"), "complete": doc.get("complete"), "cases": cases}


def section_benchmark(run: Run) -> dict:
    """benchmarks.run with its own state: exit 3 means it went as far as the deadline let it."""
    out = run.state / "bench-out"
    argv = [
        run.python,
        "-m",
        "benchmarks.run",
        *benchmark_args(run),
        "--state",
        str(run.state / "bench"),
        "--out",
        str(out),
        "--brief",
        *run.timeout_flag("--deadline"),
    ]
    earlier = run.previous("benchmark")
    outcome = run.command(argv)
    attempts = {
        "attempts": earlier.get("attempts", 0) + 1,
        "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
        "command": "python -m benchmarks.run " + shlex.join(argv[3:]),
    }
    if outcome.cut or outcome.returncode == 3:
        raise Pending("benchmarks.run has phases left; the same command goes on", attempts)
    if outcome.returncode != 0:
        raise Failed(f"benchmarks.run: exit status {outcome.returncode}: {last_line(outcome.stdout)}", attempts)
    written = sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not written:
        raise Failed(f"benchmarks.run wrote no JSON into {out}", attempts)
    return {
        **attempts,
        "json": str(written[-1].relative_to(run.state)),
        **benchmark_summary(json.loads(written[-1].read_text())),
    }


def section_estimator_vs_probe(run: Run) -> dict:
    """The estimator's prediction against every config the README's search probed."""
    device_type = "cuda" if run.cuda else "cpu"
    return run.helper("estimates", timeout=900, db=run.db("readme.db"), device_type=device_type)


def section_train_200_steps(run: Run) -> dict:
    """`autotune train` with the README search's winner under its budget: the run's peak and speed
    against its probe's."""
    study = run.sections["readme_command"].get("study")
    if not study:
        raise Failed("readme_command recorded no study name")
    data = run.state / "train-data"
    run.helper("train_data", timeout=300, directory=str(data))
    steps = 200 if run.cuda else 5
    output = run.state / "train-run"
    # A fresh directory each attempt: an earlier one's checkpoints would make this a resumed run.
    shutil.rmtree(output, ignore_errors=True)
    argv = [
        "train",
        "--study",
        study,
        "--dataset",
        str(data / "corpus.txt"),
        "--tokenizer",
        str(data / "tokenizer"),
        "--max-steps",
        str(steps),
        "--save-steps",
        str(steps * 10),
        "--device",
        run.mode,
        "--output-dir",
        str(output),
        "--db",
        run.db("readme.db"),
        "--json",
    ]
    summary = run.autotune(*argv, timeout=1200).json(accept=(0, 1), what="autotune train")
    probe = summary.get("probe") or {}
    speed, probe_speed = summary.get("tokens_per_s"), probe.get("tokens_per_s")
    required = (summary.get("peak_reserved_bytes") or 0) + (summary.get("context_bytes") or 0)
    return {
        "command": "autotune " + shlex.join(argv),
        "run_status": summary.get("status"),
        **{
            k: summary.get(k)
            for k in (
                "steps",
                "tokens_per_s",
                "wall_tokens_per_s",
                "train_seconds",
                "peak_allocated_bytes",
                "peak_reserved_bytes",
                "context_bytes",
                "budget_bytes",
                "margin_bytes",
                "cap_bytes",
                "peak_vs_probe",
                "final_loss",
                "warnings",
                "error",
            )
        },
        "config": (summary.get("config") or {}).get("label"),
        "probe": probe,
        "tokens_per_s_vs_probe": round(speed / probe_speed, 3) if speed and probe_speed else None,
        "within_budget": bool(summary.get("budget_bytes")) and required <= summary["budget_bytes"],
    }


# -- pass 2: is the pick the fastest on the card, and does the run go as fast as its probe? ----------

TRUTH_FILE = "truth.jsonl"  # every probe of the truth and of the spread, one JSON line each
# A config whose first process measured under this share of the best's cannot be the best within the
# noise between processes seen on a card (±25% on the H100, 2026-11-26: 0.75 / 1.25 = 0.6): its
# second process comes after the contenders'.
CONTENDER_SHARE = 0.6
# What the truth leaves, on a card, for the pass's sections after it that say more (train 200 steps,
# the plain Trainer, the pick in fresh processes); eval_generation gets what is left after those.
TRUTH_RESERVE_SECONDS = 170.0
# Round 1's share of the truth's time before round 2 starts on what it measured (all of it, when
# round 1 ends sooner).
ROUND_ONE_SHARE = 0.65
SPREAD_PROCESSES = 5
# On CPU the section checks its machinery, not a card's spread: two processes show it (each one is a
# fresh process's seconds of imports).
CPU_SPREAD_PROCESSES = 2
# Goals the issue sets (reported met or not).
PICK_QUALITY_GOAL, PROBES_GOAL, GPU_SECONDS_GOAL, RUN_VS_PROBE_GOAL = 0.98, 8, 0.15, 0.95


def read_rows(path: Path, prefix: str) -> list[dict]:
    """The probes `path` holds whose tag starts with `prefix` (a line cut short by a kill is left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if str(row.get("tag", "")).startswith(prefix):
            rows.append(row)
    return rows


def next_truth_round(
    keys: Sequence[str], rows: Sequence[dict], first_round_closed: bool = False
) -> tuple[str, list[str]]:
    """The truth's next round and what it has left to measure: round 1 every config in `keys`' order;
    round 2 in reverse order (so that a drift of the card over the minutes weighs on both ends
    alike), the contenders of round 1 first, configs that did not fit in round 1 left out. Once
    round 1 has had its share of the time (`first_round_closed`), round 2 takes the configs round 1
    measured so far, then round 1 goes on, and so on: whatever the deadline cuts, the contenders
    measured have their second process."""
    first = {r["key"]: r for r in rows if r["tag"] == "truth-1"}
    first_todo = [k for k in keys if k not in first]
    if first_todo and not first_round_closed:
        return "1", first_todo
    second = {r["key"] for r in rows if r["tag"] == "truth-2"}
    fits = {
        k: first[k]["tokens_per_s"]
        for k in keys
        if k in first and first[k]["status"] == "ok" and first[k].get("tokens_per_s")
    }
    best = max(fits.values(), default=0.0)
    contenders = [k for k in reversed(keys) if k in fits and fits[k] >= CONTENDER_SHARE * best]
    others = [k for k in reversed(keys) if k in fits and k not in contenders]
    second_todo = [k for k in contenders + others if k not in second]
    if second_todo or not first_todo:
        return "2", second_todo
    return "1", first_todo


def spread_of(samples: Sequence[float]) -> float | None:
    """The largest over the smallest of a config's figures from separate processes, less one."""
    return round(max(samples) / min(samples) - 1, 4) if len(samples) >= 2 and min(samples) > 0 else None


def median_of(samples: Sequence[float]) -> float | None:
    ordered = sorted(samples)
    n = len(ordered)
    if not n:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def truth_table(keys: Sequence[str], labels: Mapping[str, str], rows: Sequence[dict]) -> list[dict]:
    """Per config: each process's tokens/s, their median and spread, sorted fastest first (configs
    that never fitted last)."""
    table = []
    for key in keys:
        mine = [r for r in rows if r["key"] == key]
        samples = [r["tokens_per_s"] for r in mine if r["status"] == "ok" and r.get("tokens_per_s")]
        table.append(
            {
                "label": labels[key],
                "key": key,
                "statuses": [r["status"] for r in mine],
                "tokens_per_s": [round(s, 1) for s in samples],
                "median": median_of(samples),
                "spread": spread_of(samples),
            }
        )
    return sorted(table, key=lambda row: -(row["median"] or 0.0))


def truth_verdict(table: Sequence[dict], readme: Mapping[str, Any], rows: Sequence[dict]) -> dict:
    """The search's pick against the truth: its quality, probes and GPU-seconds, each goal beside it."""
    measured = [row for row in table if row["median"]]
    if not measured:
        return {"pick_quality": None}
    best = measured[0]
    pick_label = (readme.get("pick") or {}).get("label")
    pick = next((row for row in measured if row["label"] == pick_label), None)
    first_only = max(
        (r for r in rows if r["tag"] == "truth-1" and r["status"] == "ok" and r.get("tokens_per_s")),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    truth_seconds = sum(r.get("wall_seconds") or 0.0 for r in rows)
    round_one_seconds = sum(r.get("wall_seconds") or 0.0 for r in rows if r["tag"] == "truth-1")
    search_seconds = readme.get("search_seconds") or 0.0
    quality = round(pick["median"] / best["median"], 4) if pick else None
    spreads = [row["spread"] for row in measured if row["spread"] is not None]
    return {
        "best": {"label": best["label"], "median": best["median"], "tokens_per_s": best["tokens_per_s"]},
        "pick": {
            "label": pick_label,
            "search_tokens_per_s": (readme.get("pick") or {}).get("tokens_per_s"),
            "truth_median": pick["median"] if pick else None,
            "truth_tokens_per_s": pick["tokens_per_s"] if pick else None,
        },
        "pick_quality": quality,
        "pick_quality_goal": PICK_QUALITY_GOAL,
        "pick_quality_met": quality is not None and quality >= PICK_QUALITY_GOAL,
        "pick_is_truth_best": pick_label == best["label"],
        "search_probes": readme.get("probes"),
        "probes_goal": PROBES_GOAL,
        "probes_met": readme.get("probes") is not None and readme["probes"] <= PROBES_GOAL,
        "truth_probes": len(rows),
        "truth_gpu_seconds": round(truth_seconds, 1),
        "truth_round_one_gpu_seconds": round(round_one_seconds, 1),
        "search_seconds": search_seconds,
        # Against one round of the truth: what an exhaustive search of one process per config costs.
        "search_vs_truth_gpu_seconds": round(search_seconds / round_one_seconds, 3) if round_one_seconds else None,
        "gpu_seconds_goal": GPU_SECONDS_GOAL,
        # What a truth of one process per config would have called the best.
        "one_process_truth_best": next(row["label"] for row in table if row["key"] == first_only["key"])
        if first_only
        else None,
        "between_processes_spread": {
            "median": median_of(spreads),
            "max": max(spreads, default=None),
            "configs": len(spreads),
        },
    }


def study_candidates(run: Run, db: str, study: str) -> dict:
    """helper_truth_candidates' answer for the README's study, asked once per state (the truth, the
    spread and probe_overhead each need it; the study does not change once searched)."""
    path = run.state / "truth-candidates.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("study") == study:
            return saved["candidates"]
    candidates = run.helper("truth_candidates", timeout=300, db=db, study=study)
    path.write_text(json.dumps({"study": study, "candidates": candidates}))
    return candidates


def section_truth(run: Run) -> dict:
    """The ground truth that the noise between processes cannot fool: every config of the README's
    search that its memory predictions do not rule out, each probed in fresh processes (round 1 in
    the space's order, round 2 in reverse), its figure the median; the search's pick held against it."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    if not study:
        raise Failed("readme_command recorded no study name")
    candidates = study_candidates(run, db, study)
    # Round 1 starts with what the search measured (its pick, the configs it was told apart from),
    # so that a deadline leaves out the configs it did not measure rather than these.
    ordered = sorted(candidates["measured"], key=lambda c: c["search_status"] not in ("ok", "oom"))
    keys = [c["key"] for c in ordered]
    labels = {c["key"]: c["label"] for c in ordered}
    path = run.state / TRUTH_FILE
    reserve = TRUTH_RESERVE_SECONDS if run.cuda else 0.0

    def figures() -> dict:
        rows = read_rows(path, "truth-")
        table = truth_table(keys, labels, rows)
        return {
            "candidates": candidates["candidates"],
            "measured_configs": len(keys),
            "ruled_out_by_memory": candidates["ruled_out_by_memory"],
            "without_prediction": candidates["without_prediction"],
            "window": candidates["window"],
            "search_confirmation": candidates["confirmation"],
            "contender_share": CONTENDER_SHARE,
            "rounds": {tag: sum(1 for r in rows if r["tag"] == tag) for tag in ("truth-1", "truth-2")},
            **truth_verdict(table, readme, rows),
            "table": table,
            "probes": rows,
        }

    left = run.deadline.left()
    seconds = 1e9 if left is None else left - reserve - WRAP_UP_SECONDS
    if next_truth_round(keys, read_rows(path, "truth-"), True)[1]:
        if seconds < 20:
            raise Pending(
                f"{seconds + reserve:.0f} s left of the {20 + reserve:.0f} the truth needs to probe", figures()
            )
        try:
            # One chain of processes for every round: a probe's process is started while the last runs.
            run.helper(
                "fresh_probes",
                timeout=seconds + KILL_GRACE_SECONDS + 60,
                db=db,
                study=study,
                results=str(path),
                seconds=seconds,
                truth_keys=keys,
                round_one_seconds=ROUND_ONE_SHARE * seconds,
            )
        except SectionEnd as end:
            end.figures = figures()
            raise
    round_name, todo = next_truth_round(keys, read_rows(path, "truth-"), True)
    if todo:
        raise Pending(f"round {round_name} has {len(todo)} configs left; the same command goes on", figures())
    return figures()


def section_probe_overhead(run: Run) -> dict:
    """Where a probe's seconds go, in a warm child: the pick, another config the search measured, the
    pick again (the first probe of a process and the later ones differ on a card)."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    pick = (readme.get("pick") or {}).get("label")
    measured = [p for p in readme.get("probes_stored", []) if p.get("status") == "ok"]
    by_label = {p["label"]: p for p in measured}
    if pick not in by_label:
        raise Failed(f"the pick {pick!r} is not among the probes the search stored")
    other = next((p for p in measured if p["label"] != pick), by_label[pick])
    candidates = study_candidates(run, db, study)
    key_of = {c["label"]: c["key"] for c in candidates["measured"]}
    keys = [key_of[pick], key_of[other["label"]], key_of[pick]]
    figures = run.helper("probe_phases", timeout=300, db=db, study=study, keys=keys)
    return figures


def section_spread(run: Run) -> dict:
    """The pick in SPREAD_PROCESSES fresh processes (CPU_SPREAD_PROCESSES on CPU), one after another:
    the spread between them, against the noise the search judged its pick by."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    pick = (readme.get("pick") or {}).get("label")
    candidates = study_candidates(run, db, study)
    key = next((c["key"] for c in candidates["measured"] if c["label"] == pick), None)
    if key is None:
        raise Failed(f"the pick {pick!r} is not among the study's configs")
    path = run.state / TRUTH_FILE
    wanted = SPREAD_PROCESSES if run.cuda else CPU_SPREAD_PROCESSES
    left = wanted - len(read_rows(path, "spread"))
    if left > 0:
        seconds = 1e9 if run.deadline.left() is None else run.deadline.left() - WRAP_UP_SECONDS
        run.helper(
            "fresh_probes",
            timeout=seconds + KILL_GRACE_SECONDS + 60,
            db=db,
            study=study,
            keys=[key] * left,
            results=str(path),
            seconds=seconds,
            tag="spread",
        )
    rows = read_rows(path, "spread")
    samples = [r["tokens_per_s"] for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    confirmation = candidates["confirmation"] or {}
    figures = {
        "config": pick,
        "processes": len(rows),
        "statuses": [r["status"] for r in rows],
        "tokens_per_s": [round(s, 1) for s in samples],
        "median": median_of(samples),
        "min": min(samples, default=None),
        "max": max(samples, default=None),
        "spread": spread_of(samples),
        "step_spreads": [r.get("step_spread") for r in rows],
        "search_tokens_per_s": (readme.get("pick") or {}).get("tokens_per_s"),
        "search_noise": confirmation.get("noise"),
        "search_confirmation": confirmation,
        "startup_seconds": [r.get("startup_seconds") for r in rows],
    }
    if len(rows) < wanted:
        raise Pending(f"{wanted - len(rows)} processes left", figures)
    return figures


def section_trainer_handoff(run: Run) -> dict:
    """The README's hand-off in a plain transformers Trainer (`best.training_arguments()`,
    `best.load_model()`), 200 steps on `autotune train`'s data: its tokens/s against the probe's."""
    readme = run.sections["readme_command"]
    data = run.state / "train-data"  # (made by helper_trainer_handoff where train_200_steps did not)
    output = run.state / "handoff-run"
    shutil.rmtree(output, ignore_errors=True)
    steps = 200 if run.cuda else 5
    result = run.helper(
        "trainer_handoff",
        timeout=900,
        db=run.db("readme.db"),
        study=readme.get("study"),
        data_dir=str(data),
        output_dir=str(output),
        steps=steps,
    )
    probe = (readme.get("pick") or {}).get("tokens_per_s")
    truth = (run.sections.get("truth") or {}).get("pick") or {}
    train = run.sections.get("train_200_steps") or {}
    ratio = round(result["tokens_per_s"] / probe, 3) if result.get("tokens_per_s") and probe else None
    return {
        **result,
        "probe_tokens_per_s": probe,
        "tokens_per_s_vs_probe": ratio,
        "goal": RUN_VS_PROBE_GOAL,
        "met": ratio is not None and ratio >= RUN_VS_PROBE_GOAL,
        "tokens_per_s_vs_truth_median": (
            round(result["tokens_per_s"] / truth["truth_median"], 3)
            if result.get("tokens_per_s") and truth.get("truth_median")
            else None
        ),
        "autotune_train_tokens_per_s": train.get("tokens_per_s"),
        "autotune_train_vs_probe": train.get("tokens_per_s_vs_probe"),
    }


def eval_generation_searches(run: Run) -> dict[str, list[str]]:
    """gpt2 evaluated during training (eval batches after the training steps), and a Pegasus-shaped
    seq2seq model that generates (predict_with_generate, beams); on CPU their tiny shapes."""
    if run.cuda:
        pegasus = run.state / "pegasus-shaped"
        pegasus.mkdir(parents=True, exist_ok=True)
        (pegasus / "config.json").write_text(json.dumps(PEGASUS_SHAPED))
        gpt2 = [
            "--model",
            "gpt2",
            "--gpu-budget",
            "8GiB",
            "--micro-batches",
            "4,8,16",
            "--effective-batch",
            "16",
            "--block-sizes",
            "512",
            "--precisions",
            "bf16",
            "--checkpointing",
            "off,on",
            "--attention",
            "sdpa",
        ]
        seq2seq = [
            "--model",
            str(pegasus),
            "--gpu-budget",
            "16GiB",
            "--micro-batches",
            "2,4,8",
            "--effective-batch",
            "8",
            "--block-sizes",
            "512",
            "--target-length",
            "128",
            "--precisions",
            "bf16",
            "--checkpointing",
            "off,on",
        ]
    else:
        pegasus = run.state / "tiny-pegasus"
        pegasus.mkdir(parents=True, exist_ok=True)
        (pegasus / "config.json").write_text(json.dumps(TINY_PEGASUS))
        # One candidate each: what the CPU mode checks is that the phases run and their figures arrive.
        tiny = [
            "--device",
            "cpu",
            "--no-predict",
            "--micro-batches",
            "2",
            "--effective-batch",
            "2",
            "--precisions",
            "fp32",
            "--checkpointing",
            "off",
            "--measure-seconds",
            "0.2",
        ]
        gpt2 = [
            "--model",
            str(run.tiny_model),
            "--gpu-budget",
            "1GiB",
            "--block-sizes",
            "64",
            "--attention",
            "sdpa",
            *tiny,
        ]
        seq2seq = [
            "--model",
            str(pegasus),
            "--gpu-budget",
            "1GiB",
            "--block-sizes",
            "64",
            "--target-length",
            "16",
            "--attention",
            "sdpa",
            *tiny,
        ]
    return {
        "gpt2_eval": [*gpt2, "--eval-batch", "auto"],
        "seq2seq_generate": [*seq2seq, "--eval-batch", "auto", "--generate", "--num-beams", "2"],
    }


def section_eval_generation(run: Run) -> dict:
    """Searches whose probes run the evaluation (and generation) phases after the training steps:
    the phases' peaks on the card, each run's pick. A search the deadline cut resumes."""
    searches: dict[str, dict] = {}
    for name, args in eval_generation_searches(run).items():
        earlier = run.previous("eval_generation").get("searches", {}).get(name, {})
        if earlier.get("study_status") == "finished":
            searches[name] = earlier
            continue
        try:
            searches[name] = run_search(run, earlier, args, run.db(f"{name}.db"))
        except SectionEnd as end:
            end.figures = {"searches": {**searches, name: end.figures}}
            raise
    return {"searches": searches}


# The data_lengths section's examples (benchmarks/real_lengths.py's long tail, scaled): on the card a
# median of 192 tokens cut at 1,024, so that padding and the attention over a padding-free row are a
# card's work; on CPU the benchmark's own (median 24, cut at 128) on its 4-layer model.
LENGTHS_ON_CARD = {"block": 1024, "median": 192.0, "micro_batches": "4,8,16,32", "effective_batch": "32"}
LENGTHS_ON_CPU = {"block": 128, "median": 24.0, "micro_batches": "2,4", "effective_batch": "4"}


def section_data_lengths(run: Run) -> dict:
    """Fastest on the user's data, on the card (issue 57): a causal LM trained one example per row,
    as TRL's SFTTrainer trains it, on long-tailed examples; the search chooses among micro-batches,
    padded and padding-free. Then the real TRL runs of its pick and of the fastest padded config
    (real tokens/s against the probes'), and `plan --dataset`'s predictions for the same configs: the
    ratios between configs, predicted against measured."""
    shape = LENGTHS_ON_CARD if run.cuda else LENGTHS_ON_CPU
    work = run.state / "lengths"
    data = run.helper(
        "lengths_data", timeout=600, directory=str(work), block=shape["block"], median=shape["median"], card=run.cuda
    )
    # (the block above the longest example, TRL's end-of-sequence token included: the data caps it, and
    # TRL cuts no example under padding_free)
    space = [
        "--model",
        str(work / "model"),
        "--trainer",
        "trl",
        "--packing",
        "off",
        "--dataset",
        str(work / "data" / "examples.jsonl"),
        "--tokenizer",
        str(work / "data" / "tokenizer"),
        "--micro-batches",
        shape["micro_batches"],
        "--effective-batch",
        shape["effective_batch"],
        "--block-sizes",
        str(2 * shape["block"]),
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--precisions",
        "bf16" if run.cuda else "fp32",
    ]
    probing = (
        ["--gpu-budget", "32GiB"]
        if run.cuda
        else ["--gpu-budget", "2GiB", "--device", "cpu", "--no-predict", "--measure-seconds", "0.5"]
    )
    db = run.db("lengths.db")
    searches = dict(run.previous("data_lengths").get("searches", {}))
    # The padded configs alone come second: the probes of the first, reused (same database), their
    # pick the fastest padded config.
    for name, padding_free in (("lengths", "off,on"), ("lengths-padded", "off")):
        if searches.get(name, {}).get("study_status") == "finished":
            continue
        try:
            searches[name] = run_search(
                run, searches.get(name, {}), [*space, *probing, "--padding-free", padding_free, "--study", name], db
            )
        except SectionEnd as end:
            end.figures = {"data": data, "searches": {**searches, name: end.figures}}
            raise
    searched, padded = searches["lengths"], searches["lengths-padded"]
    steps = 60 if run.cuda else 12
    runs = {
        name: run.helper("lengths_run", timeout=900, db=db, study=study, work=str(work), steps=steps)
        for name, study in (("pick", "lengths"), ("padded_pick", "lengths-padded"))
    }
    for name, search in (("pick", searched), ("padded_pick", padded)):
        probe = (search.get("pick") or {}).get("tokens_per_s")
        real = runs[name].get("real_tokens_per_s")
        runs[name].update(
            label=(search.get("pick") or {}).get("label"),
            probe_tokens_per_s=probe,
            probe_over_real=round(probe / real, 3) if probe and real else None,
        )
    card = ["--gpu", gpu_card_name(run)] if run.cuda else ["--gpu", "cpu", "--gpu-budget", "2GiB"]
    plan = run.autotune("plan", *space, "--padding-free", "off,on", *card, "--json", timeout=600).json(
        what="autotune plan"
    )
    measured = {row["label"]: row["tokens_per_s"] for row in searched["leaderboard"] if row.get("tokens_per_s")}
    predicted = {c["label"]: c.get("tokens_per_s") for c in plan.get("candidates", []) if c.get("label") in measured}
    return {
        "data": data,
        "searches": searches,
        "runs": runs,
        "plan": {"command": "autotune plan ... " + " ".join(card), "predicted": predicted},
        "plan_vs_probes": ratios_between(predicted, measured),
    }


def gpu_card_name(run: Run) -> str:
    from autotune.cards import card_for_device

    card = card_for_device(str(run.doc.get("device") or ""))
    if card is None:
        raise Skip(f"no card of autotune's table is named like {run.doc.get('device')!r}: plan cannot price it")
    return card.short_name


def ratios_between(predicted: Mapping[str, float | None], measured: Mapping[str, float]) -> list[dict]:
    """Each config's speed against the fastest measured one's, predicted and measured."""
    best = max(measured, key=measured.__getitem__, default=None)
    if best is None or not predicted.get(best):
        return []
    return [
        {
            "label": label,
            "measured": round(speed / measured[best], 3),
            "predicted": round(predicted[label] / predicted[best], 3) if predicted.get(label) else None,
        }
        for label, speed in sorted(measured.items(), key=lambda item: -item[1])
    ]


def section_liger_allocator_search(run: Run) -> dict:
    """A search on TinyLlama-1.1B's shape with Liger's kernels and the allocator's expandable
    segments as levers: what each buys in speed and memory on the card."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger_kernel is not installed (../shared/gpu/wheels.sh bitsandbytes==0.50.2 liger-kernel)")
    model = run.state / "llama-1b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINYLLAMA_1_1B))
    db = run.db("liger.db")
    args = [
        "--model",
        str(model),
        "--gpu-budget",
        "32GiB",
        "--micro-batches",
        "2,4,8",
        "--effective-batch",
        "8",
        "--block-sizes",
        "1024",
        "--precisions",
        "bf16",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--liger",
        "off,on",
        "--allocators",
        "default,expandable",
    ]
    figures = run_search(run, run.previous("liger_allocator_search"), args, db)
    figures["levers"] = lever_effects(figures["probes_stored"])
    return figures


def lever_effects(probes: list[dict]) -> list[dict]:
    """Per config apart from the two levers: tokens/s and peak reserved with each lever value."""
    groups: dict[str, dict[str, dict]] = {}
    for p in probes:
        if p.get("status") != "ok":
            continue
        rest = {k: v for k, v in p["config"].items() if k not in ("liger", "allocator")}
        key = json.dumps(rest, sort_keys=True)
        groups.setdefault(key, {})[
            f"liger={'on' if p['config'].get('liger') else 'off'} allocator={p['config'].get('allocator')}"
        ] = {"tokens_per_s": p.get("tokens_per_s"), "peak_reserved_bytes": p.get("peak_reserved_bytes")}
    return [{"config": json.loads(key), "by_lever": values} for key, values in groups.items()]


def section_cuda_constants(run: Run) -> dict:
    """The context and the cuBLAS workspaces that cuda_facts measured, recorded where the
    estimator reads them (autotune/estimate/cuda_constants.json) and copied into --out, since the
    GPU machine's working tree does not come back."""
    from autotune.estimate.cuda_constants import CONTEXT, CUBLAS_WORKSPACES, FILE, record_measured

    checks = run.sections["cuda_facts"]["checks"]
    context = checks["context_after_step"]["after_bf16_step"]["measure_cuda_context_bytes"]
    workspace = checks["cublas_workspace"]["workspace_bytes"]
    where = f"{run.doc['device']}, driver {run.doc['driver']}, torch {run.doc['torch']}, {utc_now()[:10]}"
    record_measured(CONTEXT, int(context), where)
    record_measured(CUBLAS_WORKSPACES, int(workspace), where)
    shutil.copy(FILE, run.out / FILE.name)
    readme = run.sections.get("readme_command", {})
    probe_contexts = [p["context_bytes"] for p in readme.get("probes_stored", []) if p.get("context_bytes")]
    return {
        "recorded": {CONTEXT: int(context), CUBLAS_WORKSPACES: int(workspace)},
        "where": where,
        "file": str(FILE.relative_to(REPO)),
        "copied_to": FILE.name,
        "readme_probe_context_bytes": {"min": min(probe_contexts), "max": max(probe_contexts)}
        if probe_contexts
        else None,
    }


@dataclass(frozen=True)
class Section:
    name: str
    function: Callable[[Run], dict]
    cuda_seconds: float  # at least this long left, or it is not started (CUDA mode)
    cpu_seconds: float  # the same in CPU mode
    expected_seconds: float  # what it is expected to take on a card (a guess until measured)
    passes: tuple[str, ...]  # the GPU commands (PASSES) it is part of
    cuda_only: bool = False
    needs: tuple[str, ...] = ()  # sections that must be measured first

    def min_seconds(self, mode: str) -> float:
        return self.cuda_seconds if mode == "cuda" else self.cpu_seconds


# Each pass is one GPU command of at most 9 minutes, its sections in order of value. Pass 1 (measured
# on an H100, 2026-11-26): the README's command and what it makes checkable, pytest -m gpu with what
# is left. Pass 2 (issue 55; run on an H200, 2026-11-29): is the pick the fastest on the card (the
# noise-proof truth against the README's search from an empty database), where a probe's seconds go,
# does the run go as fast as its probe (autotune train and a plain Trainer), the spread between
# processes. Pass 3: the rest (evaluation and generation, micro-checks, the benchmark's grid, Liger and
# the allocator).
SECTIONS: tuple[Section, ...] = (
    # expected_seconds: measured on an H100 on 2026-11-26 and an H200 on 2026-11-29 (benchmarks/results/),
    # rounded up; pytest_gpu's and the truth's what their pass leaves them (both resume).
    Section("versions", section_versions, 30, 10, expected_seconds=15, passes=("1",)),
    # 88 s on the H100 (6 probes), 227 s on the H200 (11 probes, and a confirmation round of 13 windows
    # in 103 s).
    Section("readme_command", section_readme_command, 120, 30, expected_seconds=230, passes=("1", "2")),
    Section(
        "probe_overhead", section_probe_overhead, 45, 15, expected_seconds=30, passes=("2",), needs=("readme_command",)
    ),
    # Whatever the pass leaves it: on the H200 (2026-11-29) a probe in a fresh process took 8-16 s, so
    # its 45 configs want two commands of their own; it stops to leave TRUTH_RESERVE_SECONDS to the
    # sections after it, and gives the contenders it measured their second process first.
    Section("truth", section_truth, 150, 20, expected_seconds=100, passes=("2",), needs=("readme_command",)),
    Section("forum_config", section_forum_config, 60, 15, expected_seconds=30, passes=("1",)),
    Section(
        "estimator_vs_probe",
        section_estimator_vs_probe,
        45,
        15,
        expected_seconds=25,
        passes=("1",),
        needs=("readme_command",),
    ),
    Section("cuda_facts", section_cuda_facts, 60, 0, expected_seconds=35, passes=("1",), cuda_only=True),
    Section(
        "cuda_constants",
        section_cuda_constants,
        5,
        0,
        expected_seconds=1,
        passes=("1",),
        cuda_only=True,
        needs=("cuda_facts",),
    ),
    Section(
        "train_200_steps",
        section_train_200_steps,
        90,
        20,
        expected_seconds=45,
        passes=("1", "2"),
        needs=("readme_command",),
    ),
    Section(
        "trainer_handoff",
        section_trainer_handoff,
        60,
        20,
        expected_seconds=55,
        passes=("2",),
        needs=("readme_command",),
    ),
    # Five fresh processes of the pick: 73 s on the H200.
    Section("spread", section_spread, 30, 10, expected_seconds=60, passes=("2",), needs=("readme_command",)),
    # What is left of pass 1's 9 minutes; its tests resume in a later command.
    Section("pytest_gpu", section_pytest_gpu, 60, 10, expected_seconds=130, passes=("1",)),
    # gpt2's evaluating search took 76 s on the H200, the Pegasus-shaped generating one over 52.
    # Guessed (not yet run on a card): a search of 8 configs, two 60-step TRL runs, a plan.
    Section("data_lengths", section_data_lengths, 120, 30, expected_seconds=240, passes=("3",)),
    Section("eval_generation", section_eval_generation, 90, 30, expected_seconds=150, passes=("3",)),
    Section("micro_checks", section_micro_checks, 60, 0, expected_seconds=350, passes=("3",), cuda_only=True),
    Section("benchmark", section_benchmark, 120, 30, expected_seconds=600, passes=("3",)),
    Section(
        "liger_allocator_search",
        section_liger_allocator_search,
        240,
        0,
        expected_seconds=270,
        passes=("3",),
        cuda_only=True,
    ),
)
SECTION_NAMES = tuple(s.name for s in SECTIONS)
PASSES = {p: tuple(s.name for s in SECTIONS if p in s.passes) for p in ("1", "2", "3")}
# One GPU command runs at most 10 minutes; a pass plans for 9 (the preamble and the last save in the tenth).
PASS_SECONDS = 540


def attempt(run: Run, section: Section) -> dict:
    """Run one section; its record (status, seconds, figures)."""
    earlier = run.previous(section.name)
    started = time.monotonic()
    figures: dict[str, Any] = {}
    try:
        if section.cuda_only and not run.cuda:
            raise Skip("needs CUDA")
        for need in section.needs:
            status = run.sections.get(need, {}).get("status", "pending")
            if status.startswith("skipped"):
                raise Skip(f"{need} was skipped")
            if status != "measured":
                raise Pending(f"waits for {need} ({status.split(':')[0]})", earlier)
        left = run.deadline.left()
        needs = section.min_seconds(run.mode)
        if left is not None and left < needs:
            raise Pending(f"not reached: {left:.0f} s left of the {needs:.0f} it needs", earlier)
        figures, status = section.function(run), "measured"
    except SectionEnd as end:
        figures, status = end.figures, end.status
    except Exception as exc:  # a section's bug or an output it did not expect: recorded, the next goes on
        run.log.write(traceback.format_exc())
        status = f"failed: {type(exc).__name__}: {one_line(str(exc))}"
    # Summed over the attempts: a section that resumes across commands costs all of them.
    seconds = earlier.get("seconds", 0.0) + time.monotonic() - started
    return {
        "status": status,
        "seconds": round(seconds, 1),
        **{k: v for k, v in figures.items() if k not in ("status", "seconds")},
    }


def run_sections(run: Run, selected: Sequence[str]) -> int:
    """Each selected section not already done, in order; the exit status."""
    try:
        for section in SECTIONS:
            if section.name not in selected:
                continue
            status = str(run.sections.get(section.name, {}).get("status"))
            if is_done(status):
                run.say(
                    f"{section.name}: already {status.split(':')[0]} (in {run.state / EVIDENCE_FILE}); not run again"
                )
                continue
            run.say(
                f"{section.name}: starting"
                + (f" ({run.deadline.left():.0f} s left)" if run.deadline.left() is not None else "")
            )
            run.sections[section.name] = attempt(run, section)
            run.say(
                f"{section.name}: {run.sections[section.name]['status']} ({run.sections[section.name]['seconds']} s)"
            )
            run.save()
    except (Interrupted, KeyboardInterrupt):
        run.say("stopped (SIGTERM or Ctrl-C): the section in flight stays pending; the same command goes on")
        run.save()
        return EXIT_PENDING
    statuses = [run.sections[name]["status"] for name in selected]
    if any(s.startswith("failed") for s in statuses):
        return EXIT_FAILED
    return EXIT_DONE if all(is_done(s) for s in statuses) else EXIT_PENDING


# -- the document -------------------------------------------------------------------------------------


def nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def cuda_device() -> dict:
    """The card as torch sees it, asked in a child (the orchestrator does not import torch). Raises
    UsageError when there is none: no driver, or torch without CUDA."""
    if not (shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia")):
        raise UsageError(
            "no CUDA device here (no NVIDIA driver); run on the GPU machine, or give --cpu for the CPU mode"
        )
    code = "import sys; from benchmarks.gpu_evidence import helper_main; helper_main(['device_info', '{}'])"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    except subprocess.TimeoutExpired:
        raise UsageError(
            "asking torch for the CUDA device took over 5 minutes; is the card healthy? (nvidia-smi)"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    info = json.loads(lines[-1][len(RESULT_MARK) :]) if lines else {}
    if not info.get("cuda_available"):
        raise UsageError(
            f"torch sees no CUDA device here ({info.get('why') or last_line(done.stderr) or 'no answer'}); "
            f"give --cpu for the CPU mode"
        )
    return info


def new_document(mode: str, device: dict, argv: Sequence[str]) -> dict:
    from benchmarks.report import slug

    today = utc_now()[:10]
    return {
        "evidence": "autotune's CUDA claims, measured (benchmarks/gpu_evidence.py)",
        "mode": mode,
        "device": device.get("device"),
        "device_total_bytes": device.get("device_total_bytes"),
        "compute_capability": device.get("compute_capability"),
        "driver": nvidia_driver(),
        "cuda": device.get("cuda"),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "python": sys.version.split()[0],
        "autotune_version": __version__,
        "date": utc_now(),
        "updated": utc_now(),
        "host_cpus": os.cpu_count(),
        "command": "python -m benchmarks.gpu_evidence " + shlex.join(argv),
        # Where this document is committed (docs/gpu-evidence.md).
        "results_file": f"benchmarks/results/{slug(str(device.get('device')))}-gpu-evidence-{today}.json",
        "sections": {},
    }


def load_document(state: Path, fresh: dict) -> dict:
    """The earlier run's document from the state (its sections and first date kept), else `fresh`.
    A state measured on another device or in the other mode is refused: mixing them is not evidence."""
    path = state / EVIDENCE_FILE
    if not path.exists():
        return fresh
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{path} is not JSON; move it away or give another --state") from None
    for key in ("mode", "device"):
        if earlier.get(key) != fresh[key]:
            raise UsageError(
                f"{path} holds a run with {key} {earlier.get(key)!r}, not {fresh[key]!r}; give another --state"
            )
    kept = {key: earlier[key] for key in ("date", "results_file") if key in earlier}
    return {**fresh, **kept, "sections": earlier.get("sections", {})}


def pending_sections(doc: dict) -> None:
    """Every section named in the document, those never run as pending."""
    sections = doc["sections"]
    doc["sections"] = {
        name: sections.get(name) or {"status": "pending: not run yet", "seconds": 0.0} for name in SECTION_NAMES
    }


# -- command line ---------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m benchmarks.gpu_evidence", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"directory for {EVIDENCE_FILE} and {LOG_FILE}")
    p.add_argument("--state", help="directory keeping finished work between commands [default: --out]")
    p.add_argument(
        "--deadline", type=float, help="seconds this command may take; no section starts that cannot end in them"
    )
    p.add_argument("--sections", help=f"comma list of {', '.join(SECTION_NAMES)} [default: all]")
    p.add_argument(
        "--pass",
        dest="pass_",
        choices=sorted(PASSES),
        help="the sections of one GPU command: " + "; ".join(f"{p} {','.join(n)}" for p, n in PASSES.items()),
    )
    p.add_argument(
        "--cpu", action="store_true", help="the CPU mode: a tiny GPT-2, MiB budgets, CUDA-only sections skipped"
    )
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    args = build_parser().parse_args(argv)
    if args.sections and args.pass_:
        raise UsageError("give --sections or --pass, not both")
    named = args.sections or ",".join(PASSES[args.pass_] if args.pass_ else SECTION_NAMES)
    selected = [s.strip() for s in named.split(",") if s.strip()]
    unknown = [s for s in selected if s not in SECTION_NAMES]
    if unknown or not selected:
        raise UsageError(
            f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTION_NAMES)}"
        )
    if args.deadline is not None and args.deadline <= 0:
        raise UsageError(f"--deadline must be a positive number of seconds (got {args.deadline:g})")
    return args, selected


def prepare_state(run: Run) -> None:
    """Directories and the model configs every mode uses (their paths are part of probe keys, so
    they stay in the state, at the same place across commands)."""
    (run.state / "home").mkdir(parents=True, exist_ok=True)
    run.tiny_model.mkdir(parents=True, exist_ok=True)
    (run.tiny_model / "config.json").write_text(json.dumps(TINY_GPT2))


def on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    deadline_start = time.monotonic()
    try:
        args, selected = parse(argv)
        mode = "cpu" if args.cpu else "cuda"
        device = {"device": f"cpu: {cpu_name()}"} if args.cpu else cuda_device()
        out = Path(args.out).resolve()
        state = Path(args.state).resolve() if args.state else out
        doc = load_document(state, new_document(mode, device, argv))
    except UsageError as exc:
        print(f"gpu_evidence: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    seconds = None if args.deadline is None else args.deadline - (time.monotonic() - deadline_start)
    out.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    pending_sections(doc)
    signal.signal(signal.SIGTERM, on_sigterm)
    with open(out / LOG_FILE, "a") as log:
        run = Run(out=out, state=state, mode=mode, deadline=Deadline(seconds), log=log, doc=doc)
        run.say(
            f"gpu_evidence {utc_now()}: {mode} mode on {doc['device']}; sections {', '.join(selected)}; "
            f"state {state}" + (f"; deadline {seconds:.0f} s" if seconds is not None else "")
        )
        prepare_state(run)
        run.save()
        status = run_sections(run, selected)
        summary = ", ".join(f"{name} {run.sections[name]['status'].split(':')[0]}" for name in selected)
        run.say(f"done (exit {status}): {summary}")
    return status


# -- helpers: what runs in a child process (torch is imported here only) ---------------------------------


def helper_main(argv: Sequence[str]) -> None:
    """Entry of a helper child: HELPERS[argv[0]](**json(argv[1])), its figures as the last line."""
    name, kwargs = argv[0], json.loads(argv[1])
    figures = HELPERS[name](**kwargs)
    print(RESULT_MARK + json.dumps(figures, default=str), flush=True)


def error_figures(exc: BaseException) -> dict:
    from autotune.probe.oom import is_oom

    text = str(exc)
    return {
        "error_type": f"{type(exc).__module__}.{type(exc).__name__}",
        "message": one_line(text, 500),
        "autotune_says_oom": is_oom(type(exc).__name__, text),
    }


def helper_device_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False, "why": f"torch {torch.__version__} built for CUDA {torch.version.cuda}"}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda_available": True,
        "device": props.name,
        "device_total_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
    }


def helper_versions(packages: list[str], load: bool) -> dict:
    """Each package's version, imported (`load`) or from its installed metadata; "missing: why" if not."""
    import importlib

    found: dict[str, str] = {}
    for name in packages:
        if not load:
            found[name] = (
                package_version(name.replace("_", "-"))
                or package_version(name)
                or ("installed, no version" if importlib.util.find_spec(name) else "missing: not installed")
            )
            continue
        try:
            module = importlib.import_module(name)
        except (
            Exception
        ) as exc:  # a package that fails to import is the finding (bitsandbytes without its CUDA library)
            found[name] = f"missing: {type(exc).__name__}: {one_line(str(exc), 200)}"
            continue
        found[name] = str(getattr(module, "__version__", None) or package_version(name) or "imported, no version")
    return found


def helper_cap_oom() -> dict:
    """set_per_process_memory_fraction to 2 GiB, 1 GiB taken, then 1.5 GiB more asked for."""
    import torch

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 2 * GiB
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    figures: dict[str, Any] = {
        "alloc_conf": {name: os.environ.get(name) for name in ALLOC_CONF_VARS},
        "cap_bytes": cap,
        "first_bytes": GiB,
        "second_bytes": int(1.5 * GiB),
    }
    first = torch.empty(GiB, dtype=torch.uint8, device=device)
    try:
        second = torch.empty(int(1.5 * GiB), dtype=torch.uint8, device=device)
        figures["raised"] = False
        del second
    except Exception as exc:  # what it raises, if anything, is the measurement
        figures.update(raised=True, is_torch_oom=isinstance(exc, torch.OutOfMemoryError), **error_figures(exc))
    figures["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del first
    return figures


def context_figures(device: Any) -> dict:
    """The context three ways: NVML's figure for this process, the card's used memory, and
    autotune's own measure_cuda_context (which prefers NVML's); each less the allocator's reserve."""
    import torch

    from autotune.probe.cap import context_bytes, measure_cuda_context
    from autotune.probe.devices import gpu_processes, own_gpu_bytes

    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    own = own_gpu_bytes(device)
    return {
        "reserved_bytes": reserved,
        "card_used_bytes": total - free,
        "nvml_own_bytes": own,
        "context_nvml_bytes": None if own is None else context_bytes(reserved, own_bytes=own),
        "context_card_bytes": context_bytes(reserved, card_used_bytes=total - free),
        "measure_cuda_context_bytes": measure_cuda_context(device),
        "gpu_processes": gpu_processes(device),
        "pid": os.getpid(),
        "pynvml": importlib.util.find_spec("pynvml") is not None,
    }


def gpt2_training_step(device: Any, block: int = 128) -> Callable[[str], float]:
    """gpt2 (124M, random weights) on `device` with fused AdamW: a function doing one optimizer step
    in the precision it is given (fp32, or bf16/fp16 under autocast)."""
    import contextlib

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotune.models import KNOWN_ARCHITECTURES

    fields = {k: v for k, v in KNOWN_ARCHITECTURES["gpt2"].items() if k not in ("model_type", "architectures")}
    model = GPT2LMHeadModel(GPT2Config(**fields)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    ids = torch.randint(0, fields["vocab_size"], (1, block), device=device)

    def step(precision: str) -> float:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        return float(loss)

    return step


def helper_context_after_step() -> dict:
    """One gpt2 training step in fp32, then one under bf16 autocast (more kernels loaded): the
    context after each."""
    import torch

    device = torch.device("cuda", 0)
    step = gpt2_training_step(device)
    step("fp32")
    after_fp32 = context_figures(device)
    step("bf16")
    return {"after_fp32_step": after_fp32, "after_bf16_step": context_figures(device)}


HOLDER = (
    "import sys, torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); "
    "print('ready', flush=True); sys.stdin.read()"
)


def helper_context_with_other_process() -> dict:
    """A second process holds 1 GiB on the card; is it counted in this one's context?"""
    import torch

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        ready = holder.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the holding process did not start (exit {holder.poll()})")
        device = torch.device("cuda", 0)
        warm = torch.ones(256, 256, device=device)
        (warm @ warm).sum().item()
        figures = context_figures(device)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
    other = GiB
    figures.update(
        other_process_bytes=other,
        holder_pid=holder.pid,
        counts_other_process=figures["measure_cuda_context_bytes"] >= other,
    )
    return figures


def helper_device_assert() -> dict:
    """An out-of-range index on CUDA (a device-side assert), then torch.cuda.mem_get_info."""
    import torch

    x = torch.zeros(8, device="cuda")
    index = torch.tensor([1000], device="cuda")
    figures: dict[str, Any] = {}
    try:
        x[index].sum().item()
        torch.cuda.synchronize()
        figures["assert_raised"] = False
    except Exception as exc:  # the device-side assert is expected here
        figures.update(assert_raised=True, assert_error=error_figures(exc))
    try:
        free, total = torch.cuda.mem_get_info()
        figures["mem_get_info"] = {"raises": False, "free_bytes": free, "total_bytes": total}
    except Exception as exc:  # whether it raises is the question
        figures["mem_get_info"] = {"raises": True, **error_figures(exc)}
    try:
        figures["memory_reserved_after"] = {"raises": False, "bytes": torch.cuda.memory_reserved()}
    except Exception as exc:  # the allocator's own counters need no device call: do they still answer?
        figures["memory_reserved_after"] = {"raises": True, **error_figures(exc)}
    return figures


def helper_allocator_settings() -> dict:
    """Whether this process's allocator runs expandable segments: the snapshot's `is_expandable`
    where torch reports it, else 8 large blocks in one segment (expandable) or eight."""
    import torch

    device = torch.device("cuda", 0)
    blocks = [torch.empty(32 * MiB, dtype=torch.uint8, device=device) for _ in range(8)]
    segments = torch.cuda.memory_snapshot()
    large = [s for s in segments if s.get("segment_type") == "large"]
    flags = sorted({bool(s["is_expandable"]) for s in segments if "is_expandable" in s})
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = None
    if getter is not None:
        try:
            settings = str(getter())
        except Exception as exc:  # a private API: record what it said
            settings = f"raised {type(exc).__name__}: {one_line(str(exc))}"
    del blocks
    return {
        "env": {name: os.environ.get(name) for name in ALLOC_CONF_VARS},
        "large_segments": len(large),
        "is_expandable_flags": flags,
        "allocator_settings": settings,
        "expandable": flags == [True] if flags else len(large) == 1,
    }


def helper_cublas_workspace() -> dict:
    """cuBLAS's workspaces in a fresh process: allocated bytes a first fp32 matmul and its backward
    add beyond their tensors, and what clearing the workspaces gives back."""
    import torch

    device = torch.device("cuda", 0)
    a = torch.randn(1024, 1024, device=device, requires_grad=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    c = a @ a
    torch.cuda.synchronize(device)
    forward = torch.cuda.memory_allocated(device) - before - c.numel() * c.element_size()
    c.sum().backward()
    torch.cuda.synchronize(device)
    assert a.grad is not None
    live = c.numel() * c.element_size() + a.grad.numel() * a.grad.element_size()
    after_backward = torch.cuda.memory_allocated(device) - before - live
    # What the estimator adds is what is allocated beyond the tensors once a step's forward and
    # backward have run (two threads, two handles); clearing the workspaces is the cross-check.
    figures: dict[str, Any] = {
        "forward_workspace_bytes": forward,
        "after_backward_workspace_bytes": after_backward,
        "workspace_bytes": after_backward,
    }
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        held = torch.cuda.memory_allocated(device)
        clear()
        figures["cleared_bytes"] = held - torch.cuda.memory_allocated(device)
    figures["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return figures


def helper_bitsandbytes_import() -> dict:
    """Does importing bitsandbytes start CUDA in this process (a context of its own)?"""
    import torch

    before = torch.cuda.is_initialized()
    import bitsandbytes

    figures: dict[str, Any] = {
        "bitsandbytes": getattr(bitsandbytes, "__version__", None),
        "cuda_initialized_before": before,
        "cuda_initialized_after": torch.cuda.is_initialized(),
    }
    try:  # NVML by index: asking torch for the device's UUID would start CUDA itself
        import pynvml  # type: ignore[import-not-found]  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        listed = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        figures.update(nvml_lists_this_process=os.getpid() in listed, nvml_own_bytes=listed.get(os.getpid()))
    except Exception as exc:  # no NVML here: the torch flag above is the answer
        figures["nvml"] = f"unavailable: {type(exc).__name__}: {one_line(str(exc))}"
    return figures


def helper_handoff_compile(model_dir: str, output_dir: str, drop_tf32: bool) -> dict:
    """Two Trainer steps of the tiny GPT-2 with the hand-off's TrainingArguments for a compiled fp32
    winner (drop_tf32: without the `tf32` the hand-off always names)."""
    import torch
    import transformers
    from transformers import AutoConfig, Trainer, TrainingArguments

    from autotune.config import ProbeConfig
    from autotune.handoff import BestConfig
    from autotune.store import LeaderboardRow

    config = ProbeConfig(model=model_dir, micro_batch=2, block_size=64, precision="fp32", compile=True)
    row = LeaderboardRow(
        rank=1,
        study="gpu-evidence",
        probe_id=0,
        trial_number=None,
        config=config,
        config_key=config.key(),
        status="ok",
        tokens_per_s=None,
        step_seconds=None,
        samples_per_s=None,
        mfu=None,
        peak_allocated_bytes=None,
        peak_reserved_bytes=None,
        context_bytes=None,
        budget_bytes=8 * GiB,
        margin_bytes=0,
    )
    best = BestConfig(row, device_type="cuda")
    kwargs = best.trainer_kwargs()
    if drop_tf32:
        kwargs.pop("tf32", None)
    figures: dict[str, Any] = {
        "trainer_kwargs": kwargs,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    args = TrainingArguments(
        output_dir=output_dir, max_steps=2, report_to="none", save_strategy="no", logging_steps=1, **kwargs
    )
    model = best.load_model(AutoConfig.from_pretrained(model_dir))
    vocab = model.config.vocab_size
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (8, 64))]
    try:
        result = Trainer(model=model, args=args, train_dataset=data).train()
        figures.update(ok=True, train_loss=result.training_loss)
    except Exception as exc:  # the error (torch.compile refusing mixed TF32 APIs) is the finding
        figures.update(ok=False, **error_figures(exc), message_tail=last_line(str(exc), 500))
    for name in ("fp32_precision", "allow_tf32"):
        try:
            figures[f"matmul_{name}"] = str(getattr(torch.backends.cuda.matmul, name))
        except Exception as exc:  # reading the legacy flag beside the new API can raise
            figures[f"matmul_{name}"] = f"raised {type(exc).__name__}: {one_line(str(exc))}"
    return figures


def helper_lengths_data(directory: str, block: int, median: float, card: bool) -> dict:
    """benchmarks/real_lengths.py's data (a corpus, a tokenizer, 4,000 long-tailed examples) and its
    model: GPT-2's shape on a card, the benchmark's 4-layer one on CPU."""
    from benchmarks import real_lengths

    work = Path(directory)
    helper_train_data(str(work / "data"))
    (work / "model").mkdir(parents=True, exist_ok=True)
    shape = (
        {
            "model_type": "gpt2",
            "n_layer": 12,
            "n_embd": 768,
            "n_head": 12,
            "vocab_size": 50257,
            "n_positions": 2 * block,
        }
        if card
        else {**real_lengths.MODEL, "n_positions": 2 * block}
    )
    (work / "model" / "config.json").write_text(json.dumps(shape))
    return real_lengths.write_examples(work, block=block, median=median)


def helper_lengths_run(db: str, study: str, work: str, steps: int) -> dict:
    """The study's pick trained by TRL's SFTTrainer on the examples (benchmarks/real_lengths.py):
    real tokens/s after its first steps, counted at the collator."""
    from benchmarks import real_lengths

    return real_lengths.real_in_process(db, study, work, "sft", steps)


def helper_study_probes(db: str) -> dict:
    """Every probe stored in `db`, compact."""
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        records = store.probes()
    return {
        "probes": [
            {
                "label": r.config.label(),
                "config": r.config.to_dict(),
                "status": str(r.result.status),
                "tokens_per_s": r.result.tokens_per_s,
                "peak_allocated_bytes": r.result.peak_allocated_bytes,
                "peak_reserved_bytes": r.result.peak_reserved_bytes,
                "context_bytes": r.result.context_bytes,
                "wall_seconds": r.result.wall_seconds,
                "build_seconds": r.result.build_seconds,
                "measured_seconds": r.result.measured_seconds,
                "error": one_line(r.result.error or "") or None,
            }
            for r in records
        ]
    }


def ratio_error(predicted: int | None, measured: int | None) -> float | None:
    return None if not predicted or not measured else round((predicted - measured) / measured, 4)


def helper_estimates(db: str, device_type: str) -> dict:
    """Estimate vs probe for every distinct config measured in `db` (as benchmarks/estimator_vs_probe.py
    compares them, from stored probes instead of new ones)."""
    from autotune.estimate import estimate_memories
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        records = [r for r in store.probes() if str(r.result.status) in ("ok", "oom") and r.result.peak_allocated_bytes]
    measured = {r.config_key: r for r in records}
    started = time.perf_counter()
    estimates = estimate_memories([r.config for r in measured.values()], device_type=device_type, use_cache=False)
    rows: list[dict[str, Any]] = []
    for record, estimate in zip(measured.values(), estimates):
        result = record.result
        rows.append(
            {
                "label": record.config.label(),
                "status": str(result.status),
                "measured": {
                    "peak_allocated_bytes": result.peak_allocated_bytes,
                    "peak_reserved_bytes": result.peak_reserved_bytes,
                    "context_bytes": result.context_bytes,
                    "required_bytes": result.required_bytes,
                },
                "estimate": {
                    "peak_bytes": estimate.peak_bytes,
                    "reserved_bytes": estimate.reserved_bytes,
                    "context_bytes": estimate.context_bytes,
                    "required_bytes": estimate.required_bytes,
                    "breakdown": estimate.breakdown,
                },
                "error_allocated": ratio_error(estimate.peak_bytes, result.peak_allocated_bytes),
                "error_reserved": ratio_error(estimate.reserved_bytes, result.peak_reserved_bytes),
                "error_required": ratio_error(estimate.required_bytes, result.required_bytes),
            }
        )

    def spread(key: str) -> dict | None:
        # An OOM's peaks are where it stopped, not the config's need: only configs that ran count.
        errors = [abs(row[key]) for row in rows if row["status"] == "ok" and row[key] is not None]
        return (
            {"mean_abs": round(sum(errors) / len(errors), 4), "max_abs": round(max(errors), 4), "n": len(errors)}
            if errors
            else None
        )

    return {
        "device_type": device_type,
        "configs": len(rows),
        "estimate_seconds": round(time.perf_counter() - started, 1),
        "allocated": spread("error_allocated"),
        "reserved": spread("error_reserved"),
        "required": spread("error_required"),
        "rows": rows,
    }


def helper_train_data(directory: str) -> dict:
    """A corpus (the standard library's pydoc topics, ~460 KB of English) and a 500-token byte-level
    BPE tokenizer trained on it, as tests/train/conftest.py makes them (within any GPT-2 vocabulary)."""
    import pydoc_data.topics
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    root = Path(directory)
    corpus, tokenizer = root / "corpus.txt", root / "tokenizer"
    if not (corpus.exists() and (tokenizer / "tokenizer.json").exists()):
        root.mkdir(parents=True, exist_ok=True)
        topics = pydoc_data.topics.topics
        text = "\n\n".join(topics[name] for name in sorted(topics))
        corpus.write_text(text)
        special = "<|endoftext|>"
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator([text], vocab_size=500, min_frequency=2, special_tokens=[special], show_progress=False)
        PreTrainedTokenizerFast(
            tokenizer_object=bpe._tokenizer, bos_token=special, eos_token=special, unk_token=special
        ).save_pretrained(tokenizer)
    return {"corpus_bytes": corpus.stat().st_size, "tokenizer": str(tokenizer)}


# -- the noise-proof truth, the pick in fresh processes, the plain Trainer (pass 2) --------------------


@dataclass
class StudyToProbe:
    """What probing a study's configs again as its search probed them takes (read once)."""

    record: Any  # the study's StudyRecord: plan, budget, environment, confirmation
    configs: dict[str, Any]  # each config it holds a probe row for (skipped ones too), by key, as stored
    outcomes: dict[str, str]  # the search's status of each
    settings: Any  # ProbeSettings: the study's plan, on its device, with its margin
    budget: Any  # Budget: the study's, that margin kept

    @classmethod
    def read(cls, db: str, study: str) -> "StudyToProbe":
        from autotune.probe.settings import ProbeSettings
        from autotune.search.plan import StudyPlan
        from autotune.store import open_store

        with open_store(db, read_only=True) as store:
            record, probes = store.study(study), store.probes(study)
        configs: dict[str, Any] = {}
        for probe in probes:
            configs.setdefault(probe.config.key(), probe.config)
        device = str(record.environment.get("device_type") or "cuda")
        settings = ProbeSettings.from_plan(
            StudyPlan.from_dict(record.plan).probe, device=device, margin=record.margin_bytes
        )
        return cls(
            record,
            configs,
            {p.config.key(): str(p.result.status) for p in probes},
            settings,
            settings.budget(record.budget_bytes),
        )

    def spec(self) -> Any:
        from autotune.models import resolve_model

        return resolve_model(next(iter(self.configs.values())).model)


def helper_truth_candidates(db: str, study: str) -> dict:
    """Every config of the study's space that its memory predictions do not rule out (the search's
    own rule: a predicted floor over the budget by more than the prediction margin), with the
    search's outcome for each."""
    from autotune.search.plan import StudyPlan

    target = StudyToProbe.read(db, study)
    record, configs, outcomes = target.record, list(target.configs.values()), target.outcomes
    plan = StudyPlan.from_dict(record.plan)
    skip_over = int(record.budget_bytes * (1 + plan.predict_margin))
    kept, ruled_out, unpredicted = [], [], []
    for config in configs:
        prediction = plan.predictions.get(config.key())
        if prediction is not None and prediction.floor_bytes > skip_over:
            ruled_out.append(config.label())
            continue
        if prediction is None:
            unpredicted.append(config.label())
        kept.append({"key": config.key(), "label": config.label(), "search_status": outcomes.get(config.key())})
    return {
        "candidates": len(configs),
        "measured": kept,
        "ruled_out_by_memory": ruled_out,
        "without_prediction": unpredicted,
        "budget_bytes": record.budget_bytes,
        "margin_bytes": record.margin_bytes,
        "window": {k: plan.probe.get(k) for k in ("warmup_steps", "measure_steps", "measure_seconds")},
        "confirmation": record.confirmation,
    }


def probe_in_turn(
    batches: Callable[[bool], tuple[str, list[str]]],
    probe: Callable[[str, str], float],
    clock: Callable[[], float],
    seconds: float,
    round_one_seconds: float | None = None,
) -> int:
    """Probe what `batches(closed)` names, batch after batch, until it names nothing or `seconds` run
    out (no probe starts with less left than the longest one so far took); `probe(key, tag)` runs
    one and says its seconds. A batch tagged truth-1 (the truth's round 1) is left, `closed`, once
    `round_one_seconds` have passed, so that the next batch (round 2) comes first. How many probed."""
    started = clock()
    done, longest, closed = 0, 0.0, False
    while True:
        tag, todo = batches(closed)
        if not todo:
            return done
        for key in todo:
            if clock() + longest > started + seconds:
                return done
            if (
                tag == "truth-1"
                and not closed
                and round_one_seconds is not None
                and clock() + longest > started + round_one_seconds
            ):
                closed = True
                break
            longest = max(longest, probe(key, tag))
            done += 1


def helper_fresh_probes(
    db: str,
    study: str,
    results: str,
    seconds: float,
    keys: list[str] | None = None,
    tag: str = "",
    truth_keys: list[str] | None = None,
    round_one_seconds: float | None = None,
) -> dict:
    """Configs of `study`, each probed in a process of its own as the study's search probed (its
    settings and budget), the next process started while the last probe ran; one JSON line per
    probe appended to `results` as it ends. Either `keys` (repeats allowed) under `tag`, or the
    truth's rounds over `truth_keys` (next_truth_round; round 1 closed after `round_one_seconds`)
    in the same processes' chain, for at most `seconds` (probe_in_turn)."""
    from autotune.probe.runner import ProbeRunner

    target = StudyToProbe.read(db, study)
    by_key, settings, budget, spec = target.configs, target.settings, target.budget, target.spec()
    path = Path(results)
    fixed = list(keys or [])

    def batches(closed: bool) -> tuple[str, list[str]]:
        if truth_keys is None:
            todo, fixed[:] = list(fixed), []
            return tag, todo
        round_name, todo = next_truth_round(truth_keys, read_rows(path, "truth-"), closed)
        return f"truth-{round_name}", todo

    with ProbeRunner(settings, reuse_child=False, standby=True) as runner, open(path, "a") as out:

        def probe(key: str, row_tag: str) -> float:
            config = by_key[key]
            result = runner.run(config, budget, spec)
            out.write(
                json.dumps(
                    {
                        "tag": row_tag,
                        "key": key,
                        "label": config.label(),
                        "status": str(result.status),
                        "tokens_per_s": result.tokens_per_s,
                        "step_spread": result.step_spread,
                        "peak_reserved_bytes": result.peak_reserved_bytes,
                        "wall_seconds": result.wall_seconds,
                        "startup_seconds": result.startup_seconds,
                        "build_seconds": result.build_seconds,
                        "measured_seconds": result.measured_seconds,
                        "measured_steps": result.measured_steps,
                        "host_load": result.host_load,
                        "at": utc_now(),
                    }
                )
                + "\n"
            )
            out.flush()
            return result.wall_seconds or 0.0

        done = probe_in_turn(batches, probe, time.monotonic, seconds, round_one_seconds)
    return {"probed": done, "children_started": runner.children_started}


def steady_tokens_per_s(ends: list[tuple[int, float]], tokens_per_step: int, skip: int) -> float | None:
    """A run's tokens/s from (optimizer step, wall time at its end) pairs, after its first `skip` steps."""
    timed = [(step, at) for step, at in ends if step >= skip]
    if len(timed) < 2 or timed[-1][1] <= timed[0][1]:
        return None
    return tokens_per_step * (timed[-1][0] - timed[0][0]) / (timed[-1][1] - timed[0][1])


def helper_trainer_handoff(db: str, study: str, data_dir: str, output_dir: str, steps: int) -> dict:
    """The README's hand-off as a user writes it: `best.training_arguments()` and `best.load_model()`
    into a plain transformers Trainer, on the data `autotune train` had (its corpus in blocks of
    `best.block_size` tokens of its tokenizer); tokens/s after the first 10 steps, and Trainer's own."""
    import os as _os

    import autotune

    helper_train_data(data_dir)
    best = autotune.best(study, db)
    _os.environ.update(best.environment())  # the allocator's setting, before CUDA starts
    import torch
    import transformers
    from transformers import AutoTokenizer, Trainer, default_data_collator

    from autotune.models import resolve_model

    spec = resolve_model(best.config.model)
    config = transformers.AutoConfig.for_model(
        spec.config["model_type"], **{k: v for k, v in spec.config.items() if k != "model_type"}
    )
    model = best.load_model(config)
    tokenizer = AutoTokenizer.from_pretrained(Path(data_dir) / "tokenizer")
    ids = tokenizer(Path(data_dir, "corpus.txt").read_text())["input_ids"]
    block = best.block_size
    blocks = [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]
    dataset = [{"input_ids": b, "labels": b, "attention_mask": [1] * block} for b in blocks]
    args = best.training_arguments(
        output_dir,
        max_steps=steps,
        save_strategy="no",
        logging_steps=max(1, steps // 4),
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    skip = min(10, max(1, steps // 4))

    class StepClock(transformers.TrainerCallback):
        """The wall time at the end of each optimizer step, synchronised only at the first timed
        step and the last (a plain run has no synchronisation in between)."""

        ends: list[tuple[int, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (skip, state.max_steps) and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((state.global_step, time.perf_counter()))

    clock = StepClock()
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=default_data_collator, callbacks=[clock]
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    output = trainer.train()
    tokens_per_step = best.config.tokens_per_step
    steady = steady_tokens_per_s(clock.ends, tokens_per_step, skip)
    return {
        "config": best.config.label(),
        "steps": output.global_step,
        "blocks": len(blocks),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": steady,
        "trainer_tokens_per_s": tokens_per_step * output.global_step / output.metrics["train_runtime"],
        "train_runtime": output.metrics["train_runtime"],
        "final_loss": output.training_loss,
        "args": {
            k: getattr(args, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "bf16",
                "fp16",
                "gradient_checkpointing",
                "optim",
                "tf32",
                "max_grad_norm",
                "lr_scheduler_type",
            )
            if hasattr(args, k)
        },
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
    }


def helper_probe_phases(db: str, study: str, keys: list[str]) -> dict:
    """Where a probe's seconds go: `keys` (configs of `study`, run as its search ran them) probed one
    after another in this one process by the probe child's own code, as a warm child runs them,
    each step of the child timed (its start: device, NVML, cap; the model's build, the optimizer,
    the step; warm-up; window; release), with the CUDA allocator's retries (an allocation over the
    cap frees the cache and tries again) and the garbage collector's passes. On the H200
    (2026-11-29) gpt2's build took 5.4-7.4 s in every probe of a warm child but its first (0.05 s):
    80% of a probe's time."""
    import gc

    from autotune.probe import child
    from autotune.probe.protocol import ProbeRequest

    target = StudyToProbe.read(db, study)
    by_key, settings, budget, spec = target.configs, target.settings, target.budget, target.spec()
    device = settings.device
    steps: dict[str, float] = {}

    def timed(module: Any, name: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                steps[name] = steps.get(name, 0.0) + time.perf_counter() - started

        setattr(module, name, wrapper)

    for name in (
        "_start",
        "describe",
        "other_gpu_processes",
        "cap_memory",
        "build_random_model",
        "make_optimizer",
        "ProbeStep",
        "parameter_count",
        "_warm_up",
        "_time_window",
        "_release",
        "_judge",
    ):
        timed(child, name)
    collections = {"passes": 0, "seconds": 0.0}
    started_gc = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started_gc[0] = time.perf_counter()
        else:
            collections["passes"] += 1
            collections["seconds"] += time.perf_counter() - started_gc[0]

    gc.callbacks.append(on_gc)
    import torch

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    probes = []
    gc.collect()
    gc.freeze()
    for key in keys:
        steps.clear()
        collections.update(passes=0, seconds=0.0)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None
        marks: list[tuple[str, float]] = [("start", time.perf_counter())]
        request = ProbeRequest(config=by_key[key], model=spec, budget=budget, settings=settings)
        probe = child._probe_in_process(request, lambda phase: marks.append((phase, time.perf_counter())))
        marks.append(("end", time.perf_counter()))
        del probe
        gc.collect()  # what the child's loop leaves for the next probe
        gc.freeze()
        phases = {a: round(t2 - t1, 3) for (a, t1), (_, t2) in zip(marks, marks[1:])}
        probes.append(
            {
                "label": by_key[key].label(),
                "seconds": round(marks[-1][1] - marks[0][1], 3),
                "phases": phases,
                "steps": {k: round(v, 3) for k, v in steps.items()},
                "gc": {"passes": collections["passes"], "seconds": round(collections["seconds"], 3)},
                "alloc_retries": (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries) if cuda else None,
            }
        )
    gc.callbacks.remove(on_gc)
    return {"probes": probes}


HELPERS: dict[str, Callable[..., dict]] = {
    "device_info": helper_device_info,
    "versions": helper_versions,
    "cap_oom": helper_cap_oom,
    "context_after_step": helper_context_after_step,
    "context_with_other_process": helper_context_with_other_process,
    "device_assert": helper_device_assert,
    "allocator_settings": helper_allocator_settings,
    "cublas_workspace": helper_cublas_workspace,
    "bitsandbytes_import": helper_bitsandbytes_import,
    "handoff_compile": helper_handoff_compile,
    "study_probes": helper_study_probes,
    "lengths_data": helper_lengths_data,
    "lengths_run": helper_lengths_run,
    "estimates": helper_estimates,
    "train_data": helper_train_data,
    "truth_candidates": helper_truth_candidates,
    "fresh_probes": helper_fresh_probes,
    "trainer_handoff": helper_trainer_handoff,
    "probe_phases": helper_probe_phases,
}


if __name__ == "__main__":
    sys.exit(main())
