"""autotune against the exhaustive ground truth and the alternatives users reach for, in one run.

For each case (a model and an emulated memory budget) it runs, each phase with a fresh probe
worker and, for the searches, an empty database and an empty estimate cache:

1. ground truth: every configuration of the space probed (`grid-full`);
2. autotune's search as a user runs it (`frontier`, default options), from an empty database:
   probes, device seconds (probe wall time), wall time, its pick;
3. the alternatives (`benchmarks/alternatives.py`): Trainer defaults, `auto_find_batch_size`
   (accelerate's real finder), Lightning's binsearch finder where Lightning is installed;
4. the memory estimator's prediction for every configuration (beside the probes on a GPU,
   after them on a CPU);

then prints a table with the figures and writes `<out>/<device-slug>-<date>.json` and a plot
beside it (`benchmarks/report.py`).

    python -m benchmarks.run                          # a GPU: gpt2 under 8 GiB, gpt2-medium under 16 GiB
    python -m benchmarks.run --device cpu             # no GPU: the same pipeline on a tiny GPT-2

Where one command may only run so long, `--deadline SECONDS` stops starting probes in time and
`--state DIR` keeps what was finished (the searches' databases, finished phases): the same command
run again with the same `--state` continues where the last one stopped, and exits 0 once
everything is measured (3 while something is left). `--models` runs some cases only; `--merge`
adds them to an earlier run's JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from autotune.vocabulary import defaults
from autotune.results.budget import Budget
from autotune.vocabulary.version import __version__
from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment, package_version
from autotune.vocabulary.errors import AutotuneError, BadInput
from autotune.specs.models import resolve_model
from autotune.search.space import SearchSpace
from autotune.vocabulary.units import format_size, parse_size
from benchmarks import report
from benchmarks.alternatives import ALTERNATIVES, Setting

PHASES = ("ground-truth", "search", "alternatives")
INCOMPLETE_EXIT = 3
# An alternative is not interrupted once started (its finder owns the loop): start one only with
# this much of the deadline left.
MIN_SECONDS_FOR_ALTERNATIVE = 90.0
# The budgets of the issue: gpt2 on an 8 GiB card, gpt2-medium on a 16 GiB one.
DEFAULT_BUDGETS = {"gpt2": "8GiB", "gpt2-medium": "16GiB", "distilgpt2": "4GiB", "gpt2-large": "24GiB", "tiny": "12MiB"}
CUDA_MODELS = ("gpt2", "gpt2-medium")
# The CPU pipeline's model: a 2-layer GPT-2 (about 0.2 M parameters), and a space small enough to
# probe whole in a couple of minutes on two cores. Under 12 MiB the CPU accountant makes the
# largest micro-batch without checkpointing run out of memory.
TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1024,
    "n_positions": 256,
    "n_ctx": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_SPACE = dict(
    micro_batches=(1, 2, 4, 8),
    block_sizes=(64,),
    precisions=("fp32", "bf16"),
    checkpointing=(False, True),
    attentions=("sdpa",),
    effective_batch=8,
)
# A tiny model's step takes tens of milliseconds: time more of them than on a GPU, or noise decides.
CPU_MEASURE_STEPS = 5
SEARCH_STRATEGY = defaults.STRATEGY  # autotune's search as a user runs it
GROUND_TRUTH_STRATEGY = "grid-full"


@dataclass(frozen=True)
class Case:
    name: str  # as shown: 'gpt2', 'tiny-gpt2'
    model: str  # the model reference probes resolve
    budget_bytes: int
    space_args: dict = field(default_factory=dict)
    tiny: bool = False

    def space(self) -> SearchSpace:
        space = SearchSpace.build(resolve_model(self.model), **self.space_args)
        if space.effective_batch is None or len(space.block_sizes) != 1:
            raise BadInput(
                "the benchmark compares at one block size and a fixed effective batch; give one --block-size."
            )
        return space

    @property
    def slug(self) -> str:
        return report.slug(f"{self.name}-{format_size(self.budget_bytes)}")


class Deadline:
    """Seconds left for this command; no limit when `seconds` is None."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    @property
    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0


# -- estimator ------------------------------------------------------------------------------------

Estimator = Callable[[list[ProbeConfig], str], list[int]]


def autotune_estimator(configs: list[ProbeConfig], device_type: str) -> list[int]:
    """Predicted peak allocated bytes per config, from autotune's estimator (a full trace of each,
    not the search's interpolation; uncached, so that it leaves nothing for the search to reuse)."""
    from autotune.estimate import estimate_memories

    return [e.peak_bytes for e in estimate_memories(configs, device_type=device_type, use_cache=False)]


def estimator_available() -> str | None:
    """None when autotune's estimator can be imported, else why not."""
    try:
        import autotune.estimate  # noqa: F401
    except ImportError as exc:
        return f"estimator unavailable ({exc})"
    return None


class EstimateJob:
    """Predictions for a case's configurations, computed in background threads (each drives the
    estimator's own child process, a few configurations at a time so that one that cannot be
    traced costs only its batch)."""

    BATCH = 6

    def __init__(self, estimator: Estimator | None, configs: list[ProbeConfig], device_type: str, jobs: int) -> None:
        self.estimator, self.configs, self.device_type, self.jobs = estimator, configs, device_type, max(1, jobs)
        self.predicted: dict[str, int] = {}
        self.errors: list[str] = []
        self.seconds = 0.0
        self._threads: list[threading.Thread] = []

    def start(self) -> "EstimateJob":
        if self.estimator is None or self._threads:
            return self
        started = time.perf_counter()
        estimator = self.estimator
        lanes = [self.configs[i :: self.jobs] for i in range(self.jobs)]

        def work(lane: list[ProbeConfig]) -> None:
            for i in range(0, len(lane), self.BATCH):
                batch = lane[i : i + self.BATCH]
                try:
                    for config, peak in zip(batch, estimator(batch, self.device_type)):
                        self.predicted[config.key()] = int(peak)
                except (AutotuneError, OSError, RuntimeError) as exc:  # costs these rows' column, not the run
                    self.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            self.seconds = time.perf_counter() - started

        self._threads = [threading.Thread(target=work, args=(lane,), daemon=True) for lane in lanes if lane]
        for thread in self._threads:
            thread.start()
        return self

    def result(self, timeout: float | None = None) -> dict | None:
        """The predictions; None if they are not finished within `timeout` seconds."""
        if self.estimator is None:
            return {
                "status": "not-run",
                "device_type": self.device_type,
                "note": "estimator not run (--no-estimate)",
                "predicted": {},
            }
        self.start()
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            return None
        status = "ok" if not self.errors else ("partial" if self.predicted else "failed")
        return {
            "status": status,
            "device_type": self.device_type,
            "seconds": round(self.seconds, 2),
            "note": "; ".join(self.errors),
            "predicted": dict(self.predicted),
        }


# -- phases ---------------------------------------------------------------------------------------


def _progress_printer(case: Case, phase: str, stream=sys.stderr) -> Callable:
    def on_event(event) -> None:
        r = event.result
        speed = f"{r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s else ""
        print(
            f"  [{case.name} {phase} {event.resolved}/{event.total}] {event.how:<7} {event.config.label():<34} "
            f"{r.status:<7} {speed:>16} {format_size(r.required_bytes) if r.status == 'ok' else '':>11} "
            f"{r.wall_seconds or 0:6.1f} s",
            file=stream,
            flush=True,
        )

    return on_event


@contextmanager
def fresh_home(path: Path) -> Iterator[None]:
    """A phase's own AUTOTUNE_HOME: no estimate cached by an earlier run (or by this benchmark's
    estimator column) makes a search look cheaper than a user's first one."""
    path.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("AUTOTUNE_HOME")
    os.environ["AUTOTUNE_HOME"] = str(path)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("AUTOTUNE_HOME", None)
        else:
            os.environ["AUTOTUNE_HOME"] = saved


def run_search_phase(
    case: Case,
    space: SearchSpace,
    budget: int,
    margin: int,
    new_runner: Callable,
    strategy: str,
    casedir: Path,
    quiet: bool,
    timeout: float | None = None,
    predictor: Callable | None = None,
    previous_wall: float = 0.0,
) -> dict:
    """One search with the options a user gets by default, a fresh probe worker and its own
    database in `casedir` (empty the first time; a search cut short by `timeout` resumes from it).
    `predictor` replaces the search's memory prediction (tests give one matching their fake runner)."""
    from autotune.search import SearchOptions, SearchRequest, run_search
    from autotune.store import open_store

    spec = resolve_model(case.model)
    phase = "ground-truth" if strategy == GROUND_TRUTH_STRATEGY else "search"
    extra = {}
    if predictor is not None and "predictor" in inspect.signature(run_search).parameters:
        extra["predictor"] = predictor
    with (
        fresh_home(casedir / f"home-{phase}"),
        closing(new_runner()) as runner,
        open_store(f"sqlite:///{casedir / f'{phase}.db'}") as store,
    ):
        # The ground truth is every config probed once: no confirmation round there. The search's
        # round is part of what it costs, and counted in its probes.
        options = SearchOptions(
            study=phase, strategy=strategy, fresh=True, timeout=timeout, confirm=phase != "ground-truth"
        )
        outcome = run_search(
            SearchRequest.of(space, spec, Budget(budget, margin), options),
            runner,
            store,
            on_event=None if quiet else _progress_printer(case, phase),
            **extra,
        )
        records = store.probes(phase)
        confirmation = store.study(phase).confirmation or {}
    measured = [r for r in records if r.result.status != "skipped"]
    rows = [report.result_row(r.config, r.result) for r in measured]
    data = {
        "strategy": strategy,
        "complete": outcome.finished,
        "stop_reason": outcome.stop_reason,
        "probed": len(measured) + confirmation.get("probes", 0),
        "confirmation_probes": confirmation.get("probes", 0),
        "skipped": len(records) - len(measured),
        "candidates": outcome.candidates,
        "skipped_by_prediction": sum(
            (r.result.error or "").startswith("predicted") for r in records if r.result.status == "skipped"
        ),
        # Summed over the stored probes, so that a search resumed across commands counts them all.
        "gpu_seconds": sum(r.result.wall_seconds or 0.0 for r in measured) + confirmation.get("seconds", 0.0),
        "wall_seconds": previous_wall + outcome.seconds,
    }
    if strategy == GROUND_TRUTH_STRATEGY:
        data["rows"] = rows
    else:
        best = outcome.best
        pick = None
        if best is not None:
            pick = next(
                (row for row in reversed(rows) if row["key"] == best.config_key and row["status"] == "ok"), None
            )
        data.update(pick=pick, probes=rows)
    return data


def alternative_record(outcome) -> dict:
    return {
        "name": outcome.name,
        "title": outcome.title,
        "status": outcome.status,
        "note": outcome.note,
        "pick": report.result_row(outcome.config, outcome.result) if outcome.config and outcome.result else None,
        "probed": len(outcome.tried),
        "gpu_seconds": outcome.gpu_seconds,
        "wall_seconds": outcome.wall_seconds,
        "tried": [report.result_row(c, r) for c, r in outcome.tried],
    }


class PhaseState:
    """Finished phases of one case, kept in `casedir` as JSON so a later command skips them."""

    def __init__(self, casedir: Path) -> None:
        self.casedir = casedir

    def load(self, name: str) -> dict | None:
        path = self.casedir / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, name: str, data: dict) -> None:
        (self.casedir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def run_case(
    case: Case,
    *,
    env: Environment,
    new_runner: Callable,
    margin_of: Callable[[int], int],
    casedir: Path,
    phases: Sequence[str] = PHASES,
    alternatives: Sequence[str] = tuple(ALTERNATIVES),
    estimator: Estimator | None = autotune_estimator,
    estimate_jobs: int = 1,
    previous: dict | None = None,
    deadline: Deadline | None = None,
    quiet: bool = False,
    on_phase: Callable[[dict], None] | None = None,
    search_predictor: Callable | None = None,
) -> dict:
    """Every phase of one case. Phases not asked for are taken from `previous` (an earlier run's
    case); phases finished by an earlier command with the same `casedir` are not run again."""
    deadline = deadline or Deadline(None)
    casedir.mkdir(parents=True, exist_ok=True)
    state = PhaseState(casedir)
    space = case.space()
    spec = resolve_model(case.model)
    margin = margin_of(case.budget_bytes)
    candidates = space.candidates()
    data: dict = dict(previous or {})
    data.update(
        {
            "model": case.name,
            "model_reference": case.model if not case.tiny else "tiny 2-layer GPT-2 (model_config)",
            "model_config": spec.config if case.tiny else None,
            "tiny": case.tiny,
            "budget_bytes": case.budget_bytes,
            "margin_bytes": margin,
            "space": space.to_dict(),
            "candidates": len(candidates),
            "effective_batch": space.effective_batch,
            "block_size": space.block_sizes[0],
        }
    )
    pending: list[str] = []
    # On a GPU the estimator runs beside the probes (it uses only the CPU); on a CPU it would take
    # the probes' cores, so it runs after them.
    estimates = state.load("estimates")
    job = None
    if estimates is None and estimator is not None:
        job = EstimateJob(estimator, candidates, env.device_type, estimate_jobs if env.device_type == "cuda" else 1)
        if env.device_type == "cuda":
            job.start()

    def finished(phase: str, key: str, value) -> None:
        data[key] = value
        data.setdefault("measured_at", {})[phase] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if on_phase is not None:
            on_phase(data)

    def search(phase: str, key: str, strategy: str, predictor=None) -> None:
        done = state.load(phase)
        if done is not None:
            finished(phase, key, done)
            return
        if deadline.passed:
            pending.append(phase)
            return
        partial = state.load(f"{phase}.partial") or {}
        result = run_search_phase(
            case,
            space,
            case.budget_bytes,
            margin,
            new_runner,
            strategy,
            casedir,
            quiet,
            timeout=deadline.left(),
            predictor=predictor,
            previous_wall=partial.get("wall_seconds", 0.0),
        )
        if result["complete"]:
            state.save(phase, result)
        else:
            state.save(f"{phase}.partial", {"wall_seconds": result["wall_seconds"]})
            pending.append(phase)
        finished(phase, key, result)

    if "ground-truth" in phases:
        search("ground-truth", "ground_truth", GROUND_TRUTH_STRATEGY)
    if "search" in phases:
        search("search", "autotune", SEARCH_STRATEGY, search_predictor)
    if "alternatives" in phases:
        setting = Setting(
            spec=spec,
            space=space,
            budget=Budget(case.budget_bytes, margin),
            device_type=env.device_type,
            new_runner=new_runner,
        )
        records = []
        for name in alternatives:
            record = state.load(f"alternative-{name}")
            left = deadline.left()
            if record is None and (left is None or left > MIN_SECONDS_FOR_ALTERNATIVE):
                record = alternative_record(ALTERNATIVES[name](setting))
                state.save(f"alternative-{name}", record)
            if record is None:
                pending.append(f"alternative {name}")
            else:
                records.append(record)
        finished("alternatives", "alternatives", records)
    if estimates is None and job is not None and (env.device_type == "cuda" or not deadline.passed):
        estimates = job.result(timeout=deadline.left())
        if estimates is not None:
            state.save("estimates", estimates)
    if estimates is None and job is not None:
        pending.append("estimates")
    if estimates is not None:
        data["estimates"] = estimates
    elif "estimates" not in data:
        data["estimates"] = {
            "status": "not-run",
            "device_type": env.device_type,
            "predicted": {},
            "note": "estimator not run" + (" (--no-estimate)" if estimator is None else " (out of time)"),
        }
    data["pending"] = pending
    report.compute_figures(data)
    return data


def new_document(env: Environment, settings: dict) -> dict:
    return {
        "benchmark": "autotune vs exhaustive ground truth and the usual alternatives",
        "device": env.device_name,
        "device_type": env.device_type,
        "device_total_bytes": env.device_total_bytes,
        "cuda_version": env.cuda_version,
        "driver_version": env.driver_version,
        "torch_version": env.torch_version,
        "transformers_version": env.transformers_version,
        "accelerate_version": package_version("accelerate"),
        "lightning_version": package_version("lightning") or package_version("pytorch-lightning"),
        "optuna_version": package_version("optuna"),
        "autotune_version": __version__,
        "python": sys.version.split()[0],
        "date": datetime.now(timezone.utc).date().isoformat(),
        "settings": settings,
        "cases": [],
    }


def run_benchmark(
    cases: Sequence[Case],
    *,
    new_runner: Callable,
    margin_of: Callable[[int], int],
    out_dir: Path | None,
    settings: dict | None = None,
    phases: Sequence[str] = PHASES,
    alternatives: Sequence[str] = tuple(ALTERNATIVES),
    estimator: Estimator | None = autotune_estimator,
    estimate_jobs: int = 1,
    merge: dict | None = None,
    quiet: bool = False,
    env: Environment | None = None,
    search_predictor: Callable | None = None,
    state_dir: Path | None = None,
    deadline: Deadline | None = None,
) -> dict:
    """Run every case and write the report; returns the document (also written to `out_dir`).
    `doc["complete"]` is False when the deadline left something to a later run with the same
    `state_dir`."""
    if env is None:
        with closing(new_runner()) as runner:
            env = runner.environment()
    doc = new_document(env, settings or {})
    if merge is not None:
        if merge.get("device") != env.device_name:
            raise BadInput(
                f"--merge: that file was measured on {merge.get('device')!r}, not on {env.device_name!r}; "
                f"merge only runs of the same device."
            )
        doc["date"], doc["cases"] = merge.get("date", doc["date"]), list(merge.get("cases", []))

    def save(partial_case: dict | None = None) -> None:
        """The JSON after every phase, so that a command cut short leaves what it finished."""
        if out_dir is None:
            return
        snapshot = dict(doc)
        if partial_case is not None:
            snapshot["cases"] = _replace_case(list(doc["cases"]), partial_case)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{report.output_stem(snapshot)}.json").write_text(json.dumps(snapshot, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        root = state_dir if state_dir is not None else Path(tmp)
        for case in cases:
            previous = next(
                (c for c in doc["cases"] if c["model"] == case.name and c["budget_bytes"] == case.budget_bytes), None
            )
            print(
                f"{case.name} under {format_size(case.budget_bytes)} on {env.device_name}: {', '.join(phases)}",
                file=sys.stderr,
                flush=True,
            )
            data = run_case(
                case,
                env=env,
                new_runner=new_runner,
                margin_of=margin_of,
                casedir=root / case.slug,
                phases=phases,
                alternatives=alternatives,
                estimator=estimator,
                estimate_jobs=estimate_jobs,
                previous=previous,
                deadline=deadline,
                quiet=quiet,
                on_phase=lambda d: save(dict(d)),
                search_predictor=search_predictor,
            )
            doc["cases"] = _replace_case(doc["cases"], data)
            save()
    doc["complete"] = not any(case.get("pending") for case in doc["cases"])
    if out_dir is not None:
        report.write(doc, out_dir)
    else:
        for case in doc["cases"]:
            report.compute_figures(case)
    return doc


def _same_case(a: dict, b: dict) -> bool:
    return a["model"] == b["model"] and a["budget_bytes"] == b["budget_bytes"]


def _replace_case(cases: list[dict], case: dict) -> list[dict]:
    index = next((i for i, c in enumerate(cases) if _same_case(c, case)), len(cases))
    out = [c for c in cases if not _same_case(c, case)]
    out.insert(index, case)
    return out


# -- command line ---------------------------------------------------------------------------------


def _split(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def parse_cases(models: Sequence[str], args: argparse.Namespace, tiny_dir: Path) -> list[Case]:
    space_args: dict = {}
    if args.micro_batches:
        space_args["micro_batches"] = tuple(int(v) for v in _split([args.micro_batches]))
    if args.precisions:
        space_args["precisions"] = tuple(_split([args.precisions]))
    if args.checkpointing:
        flags = {"on": True, "off": False}
        values = _split([args.checkpointing])
        if any(v not in flags for v in values):
            raise BadInput(f"--checkpointing {args.checkpointing!r}: use on, off or on,off.")
        space_args["checkpointing"] = tuple(flags[v] for v in values)
    if args.attention:
        space_args["attentions"] = tuple(_split([args.attention]))
    if args.block_size:
        space_args["block_sizes"] = (args.block_size,)
    if args.effective_batch:
        space_args["effective_batch"] = args.effective_batch
    cases = []
    for item in models:
        name, _, budget = item.partition(":")
        budget = budget or DEFAULT_BUDGETS.get(name)
        if not budget:
            raise BadInput(
                f"--models {item}: give a budget as {name}:8GiB (defaults exist for {', '.join(DEFAULT_BUDGETS)})."
            )
        if name == "tiny":
            tiny_dir.mkdir(parents=True, exist_ok=True)
            (tiny_dir / "config.json").write_text(json.dumps(TINY_GPT2))
            cases.append(
                Case(
                    "tiny-gpt2",
                    str(tiny_dir),
                    parse_size(budget, flag="--models"),
                    {**TINY_SPACE, **space_args},
                    tiny=True,
                )
            )
        else:
            cases.append(Case(name, name, parse_size(budget, flag="--models"), dict(space_args)))
    return cases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (cpu runs the tiny model by default)")
    p.add_argument("--out", default="benchmarks/results", help="directory for <device>-<date>.json and .png")
    p.add_argument(
        "--models",
        nargs="+",
        help="NAME[:BUDGET] ... (default on a GPU: gpt2:8GiB gpt2-medium:16GiB; on CPU: tiny:12MiB, a 2-layer GPT-2)",
    )
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--alternatives", default=",".join(ALTERNATIVES), help=f"comma list of {', '.join(ALTERNATIVES)}")
    p.add_argument(
        "--merge",
        help="an earlier run's JSON (same device): its cases are kept, and phases not run now are taken from it",
    )
    p.add_argument("--state", help="directory keeping finished work between commands (with --deadline); default: none")
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds this command may take; no probe starts after (rerun with --state to go on)",
    )
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=None, help=f"default 3 on a GPU, {CPU_MEASURE_STEPS} on CPU")
    p.add_argument("--probe-timeout", type=float, default=300.0)
    p.add_argument("--micro-batches", help="override the space, e.g. 1,2,4,8")
    p.add_argument("--precisions", help="override the space, e.g. fp32,bf16")
    p.add_argument("--checkpointing", help="override the space: on,off")
    p.add_argument("--attention", help="override the space, e.g. sdpa")
    p.add_argument("--block-size", type=int)
    p.add_argument("--effective-batch", type=int)
    p.add_argument("--no-estimate", action="store_true", help="skip the estimator-error column")
    p.add_argument(
        "--estimate-jobs",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="estimator processes beside the GPU probes (default: a quarter of the cores, at most 4)",
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads of each CPU probe (default 1)")
    p.add_argument("--brief", action="store_true", help="print the summary only, not every ground-truth row")
    p.add_argument("--quiet", action="store_true", help="no line per probe on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from autotune.probe import ProbeRunner, ProbeSettings

    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        phases = _split([args.phases])
        alternatives = _split([args.alternatives])
        unknown = [p for p in phases if p not in PHASES] + [a for a in alternatives if a not in ALTERNATIVES]
        if unknown:
            raise BadInput(
                f"unknown phase or alternative: {', '.join(unknown)}; phases: {', '.join(PHASES)}; "
                f"alternatives: {', '.join(ALTERNATIVES)}."
            )
        merge = json.loads(Path(args.merge).read_text()) if args.merge else None
        settings = ProbeSettings(
            device=args.device,
            warmup_steps=args.warmup_steps,
            measure_steps=args.measure_steps or 3,
            timeout=args.probe_timeout,
        )
        with closing(ProbeRunner(settings)) as runner:
            env = runner.environment()
        if env.device_type == "cpu":
            if args.measure_steps is None:
                settings = replace(settings, measure_steps=CPU_MEASURE_STEPS)
            # Probe workers inherit this. One thread: a tiny model's steps are too short for more to
            # help, and on a shared machine spinning OpenMP threads make timings erratic.
            os.environ["OMP_NUM_THREADS"] = str(args.cpu_threads)
        models = _split(args.models) or (["tiny"] if env.device_type == "cpu" else list(CUDA_MODELS))
        estimator = None if args.no_estimate else autotune_estimator
        if estimator is not None and (why := estimator_available()):
            print(f"note: {why}; the estimator column stays empty", file=sys.stderr)
            estimator = None
        # Leave time for the report after the last probe.
        deadline = Deadline(None if args.deadline is None else args.deadline - (time.monotonic() - started) - 20)
        with tempfile.TemporaryDirectory(prefix="autotune-bench-model-") as tiny:
            # With --state the tiny model's directory is kept there: its path is part of every
            # config's key, which must not change between the commands that share the state.
            tiny_dir = Path(args.state) / "tiny-gpt2-model" if args.state else Path(tiny) / "tiny-gpt2"
            cases = parse_cases(models, args, tiny_dir.resolve())
            record = {
                "cpu_threads": args.cpu_threads if env.device_type == "cpu" else None,
                "warmup_steps": settings.warmup_steps,
                "measure_steps": settings.measure_steps,
                "margin": settings.margin,
                "probe_timeout": settings.timeout,
                "search_strategy": SEARCH_STRATEGY,
                "ground_truth_strategy": GROUND_TRUTH_STRATEGY,
                "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
            }
            doc = run_benchmark(
                cases,
                new_runner=lambda: ProbeRunner(settings),
                margin_of=lambda budget: settings.budget(budget).margin_bytes,
                out_dir=Path(args.out),
                settings=record,
                phases=phases,
                alternatives=alternatives,
                estimator=estimator,
                estimate_jobs=args.estimate_jobs,
                merge=merge,
                quiet=args.quiet,
                env=env,
                state_dir=Path(args.state) if args.state else None,
                deadline=deadline,
            )
    except AutotuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.format_report(doc, all_rows=not args.brief))
    files = doc.get("files", {})
    print(
        f"\nwrote {files.get('json')}"
        + (f" and {files['png']}" if files.get("png") else " (no plot: matplotlib is not installed)")
    )
    if not doc["complete"]:
        left = "; ".join(f"{c['model']}: {', '.join(c['pending'])}" for c in doc["cases"] if c.get("pending"))
        print(
            f"incomplete ({left}): run the same command again with --state {args.state} to go on"
            if args.state
            else f"incomplete ({left}): give --state DIR to keep the work between commands"
        )
        return INCOMPLETE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
