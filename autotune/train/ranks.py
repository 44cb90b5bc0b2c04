"""A run on several GPUs: `autotune train` of a winner probed on N ranks starts N ranks through
torchrun (as a probe does, autotune/probe/torchrun.py), each training with Trainer under the same
cap per rank, and keeps the run's end itself.

The process that starts the ranks owns the run: its row in the store (recorded as running before
the ranks start, its heartbeat beside them), and its end. Each rank (train/rank_main.py) trains
and leaves its own end in the run's directory (`RankRecorder`): finished, out of memory, failed or
interrupted, with its summary. The run's summary is rank 0's, its peaks the largest rank's, and
each rank's peak beside the probe's same rank. A rank out of memory is the run's out of memory:
it leaves at once, and torchrun stops the others, which would otherwise wait for it in a collective.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.vocabulary.errors import AutotuneError, BadInput
from autotune.probe.rank_main import write_whole
from autotune.probe.torchrun import RankLaunch
from autotune.levers.sharding import is_fsdp
from autotune.vocabulary.status import RunEnd
from autotune.train.options import TrainOptions, TrainOutcome
from autotune.train.run import StoreRecorder
from autotune.train.summary import RunSummary
from autotune.train.winner import Winner

JOB_FILE = "job.pickle"


class RankFailed(AutotuneError):
    """A rank of the run failed (its own error is above, in its output); the run is kept as failed."""

    exit_code = 1


POLL_SECONDS = 0.2


@dataclass(frozen=True, slots=True)
class RankJob:
    """What every rank is asked to train: the run as its starter planned it."""

    options: TrainOptions
    study: str
    model: str | None  # the model as the starter found it (--model, or the study's, made absolute)
    gpu_budget: int | None
    flags: dict[str, Any]
    db: str | None
    run_id: int


@dataclass(frozen=True, slots=True)
class RankEnd:
    """How one rank's run ended, as it left it in the run's directory."""

    status: RunEnd
    summary: RunSummary | None
    error: str | None = None


class RankRecorder:
    """A rank's side of StoreRecorder: its end goes to a file in the run's directory for the
    process that started the ranks, which keeps the run's."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.path = os.path.join(run_dir, f"rank-{rank}.end")

    def alive(self) -> nullcontext:
        return nullcontext()  # (the starter beats for the run)

    def _keep(self, end: RankEnd) -> None:
        write_whole(self.path, pickle.dumps(end))

    def failed(self, error: str, summary: RunSummary) -> None:
        self._keep(RankEnd(RunEnd.ERROR, summary, error))

    def interrupted(self, summary: RunSummary) -> None:
        self._keep(RankEnd(RunEnd.INTERRUPTED, summary))

    def out_of_memory(self, failure: str, summary: RunSummary) -> None:
        self._keep(RankEnd(RunEnd.OOM, summary, failure))

    def finished(self, summary: RunSummary) -> None:
        self._keep(RankEnd(RunEnd.FINISHED, summary))


def check_trainable_on_ranks(winner: Winner, device_type: str) -> None:
    """BadInput, before the run is recorded, for a multi-rank winner this machine cannot train as
    it was probed: accelerate (and so Trainer) shards with FSDP on GPUs only, and on a CPU device
    would train an fsdp winner as plain data-parallel, which is not what was measured."""
    config = winner.row.config
    if config.nodes > 1:
        raise BadInput(
            f"study {winner.study.name}'s winner runs on {config.nodes} nodes, and autotune train runs on one: "
            f"start the run on every node with the hand-off (`autotune best --study {winner.study.name} "
            f"--format accelerate`, then accelerate launch with each node's machine_rank)."
        )
    if device_type != "cuda" and is_fsdp(config.strategy):
        raise BadInput(
            f"study {winner.study.name}'s winner shares its run with {config.strategy}, and Trainer "
            f"(accelerate) shards with FSDP on GPUs only: on {device_type} it would train as DDP, not as "
            f"probed. Train it on {config.gpus} GPUs, or search on CPU with --strategies ddp under a new --study."
        )


def train_on_ranks(
    winner: Winner,
    options: TrainOptions,
    output_dir: Path,
    gpu_budget: int | None,
    flags: dict[str, Any],
    db: str | None,
    echo: Callable[[str], None],
    searched: bool,
    model: str | None = None,
) -> TrainOutcome:
    """Train `winner` on its `gpus` ranks and keep the run: recorded as running before the ranks
    start, ended as its ranks ended. Every rank is asked what this process was (`model` as it
    found it, the study, the budget, the flags and options), so that each plans the same run."""
    from autotune.store import open_store

    config = winner.row.config
    with open_store(db) as store:
        for abandoned in store.runs.interrupt_abandoned(str(output_dir.resolve())):
            echo(f"run #{abandoned} into {output_dir} was still marked running, its process gone: marked interrupted")
        run_id = store.runs.start(
            config=config,
            study_id=winner.study.id,
            probe_id=winner.row.probe_id,
            output_dir=str(output_dir.resolve()),
            dataset=options.dataset,
        )
        recorder = StoreRecorder(store, run_id, output_dir)
        echo(f"run #{run_id}: {config.label()} on {config.ranks} ranks (torchrun) -> {output_dir}")
        job = RankJob(options, winner.study.name, model, gpu_budget, flags, db, run_id)
        with RankLaunch("autotune-train-ranks-") as launch:
            launch.write(JOB_FILE, pickle.dumps(job))
            try:
                with recorder.alive():
                    # Rank 0 says how the run goes (on stderr: stdout stays the command's answer).
                    returncode = launch.start("autotune.train.rank_main", config.gpus, relay_to=sys.stderr).wait()
                    launch.stop()
            except BaseException:  # Ctrl-C, SIGTERM: every rank stops, the run reads as interrupted
                launch.stop()
                summary = _run_summary(_ends(launch.run_dir, config.ranks), winner)
                if summary is not None:
                    recorder.interrupted(summary)
                else:
                    store.runs.interrupt(run_id)
                raise
            ends = _ends(launch.run_dir, config.ranks)
        return _keep_end(ends, recorder, winner, run_id, output_dir, returncode, searched)


def _ends(run_dir: str, ranks: int) -> list[RankEnd | None]:
    out: list[RankEnd | None] = []
    for rank in range(ranks):
        try:
            with open(os.path.join(run_dir, f"rank-{rank}.end"), "rb") as source:
                out.append(pickle.load(source))
        except (OSError, EOFError, pickle.UnpicklingError):
            out.append(None)
    return out


def _run_summary(ends: list[RankEnd | None], winner: Winner) -> RunSummary | None:
    """Rank 0's summary (else the first rank's that has one), with every rank's peaks beside the
    probe's, and the largest rank's as the run's."""
    summaries = [end.summary if end is not None else None for end in ends]
    base = next((s for s in summaries if s is not None), None)
    if base is None:
        return None
    peaks = [
        {"allocated": s.peak_allocated_bytes, "reserved": s.peak_reserved_bytes} if s is not None else None
        for s in summaries
    ]
    known = [s for s in summaries if s is not None and s.peak_reserved_bytes is not None]
    largest = max(known, key=lambda s: s.peak_reserved_bytes or 0) if known else base
    return replace(
        base,
        rank_peaks=peaks,
        peak_allocated_bytes=largest.peak_allocated_bytes,
        peak_reserved_bytes=largest.peak_reserved_bytes,
    ).with_memory_warnings()


def _keep_end(
    ends: list[RankEnd | None],
    recorder: StoreRecorder,
    winner: Winner,
    run_id: int,
    output_dir: Path,
    returncode: int | None,
    searched: bool,
) -> TrainOutcome:
    """The run's end from its ranks': out of memory if any rank ran out, failed if any failed or
    left nothing, else finished."""
    summary = _run_summary(ends, winner)
    oom = next(((rank, end) for rank, end in enumerate(ends) if end is not None and end.status == RunEnd.OOM), None)
    if oom is not None and summary is not None:
        rank, end = oom
        message = f"rank {rank} of {len(ends)}: {end.summary.message if end.summary is not None else end.error}"
        summary = replace(summary, status=RunEnd.OOM, message=message)
        recorder.out_of_memory(f"rank {rank}: {end.error}", summary)
        return TrainOutcome(
            RunEnd.OOM, run_id, winner.study.name, str(output_dir), summary, message, list(summary.warnings), searched
        )
    failed = [(rank, end) for rank, end in enumerate(ends) if end is None or end.status != RunEnd.FINISHED]
    if failed or summary is None:
        rank, first = failed[0] if failed else (0, None)
        why = (
            first.error
            if first is not None and first.error
            else f"it ended without a result (torchrun's exit code {returncode})"
        )
        error = f"rank {rank} of {len(ends)}: {why}"
        if summary is not None:
            recorder.failed(error, replace(summary, status=RunEnd.ERROR, error=error))
        else:
            recorder.store.runs.fail(run_id, error)
        raise RankFailed(f"the run on {len(ends)} ranks failed: {error}")
    recorder.finished(summary)
    return TrainOutcome(
        RunEnd.FINISHED, run_id, winner.study.name, str(output_dir), summary, None, list(summary.warnings), searched
    )
