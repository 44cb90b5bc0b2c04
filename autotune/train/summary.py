"""What a training run did, as one typed record: `RunSummary`. Its `to_dict()` is the contract
(autotune-run.json, `autotune train --json`, the store's run summary), so its keys do not change.
No torch here: the summary is built in `autotune.train.run` and rendered by `autotune.render.tables`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget, required_bytes
from autotune.levers.config import ProbeConfig
from autotune.levers.evaluation import PHASES
from autotune.vocabulary.status import RunEnd
from autotune.levers.tasks import Task
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    from autotune.store import LeaderboardRow

SUMMARY_FILE = "autotune-run.json"
# A run's peak this far above its probe's is reported: the probe missed something the run holds.
PEAK_TOLERANCE = 0.05
# ...when the excess also takes this share of the room the probe left under the budget.
HEADROOM_SHARE = 0.25
# A run this much slower than its probe is reported, with the reasons that apply.
SPEED_TOLERANCE = 0.20
# Below this many timed steps, warm-up (the optimizer state's creation, kernels loading) weighs in.
FEW_STEPS = 10
# exp() of a larger loss says nothing a person can use (and overflows soon after).
_PERPLEXITY_MAX_LOSS = 50


@dataclass(frozen=True, slots=True)
class ProbeMeasurement:
    """What the probe that chose the configuration measured, to hold the run against."""

    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    context_bytes: int | None
    tokens_per_s: float | None
    # Each phase's peaks where the probe ran the run's evaluation (ProbeResult.phase_peaks), else None.
    phase_peaks: dict[str, dict[str, int]] | None = None
    rank_peaks: list[dict[str, int]] | None = None  # on several ranks: each rank's peaks, by rank

    @classmethod
    def of(cls, row: LeaderboardRow) -> ProbeMeasurement:
        return cls(
            row.peak_allocated_bytes,
            row.peak_reserved_bytes,
            row.context_bytes,
            row.tokens_per_s,
            row.phase_peaks,
            row.rank_peaks,
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "context_bytes": self.context_bytes,
            "tokens_per_s": self.tokens_per_s,
        }
        if self.phase_peaks is not None:  # only a probe that ran the evaluation has them
            data["phase_peaks"] = self.phase_peaks
        if self.rank_peaks is not None:  # only a probe on several ranks has them
            data["rank_peaks"] = self.rank_peaks
        return data


@dataclass(frozen=True, slots=True)
class PhasePeak:
    """One phase of a run (autotune.levers.evaluation.PHASES) against the same phase of its probe: peak
    reserved bytes each (None where that side did not run it, or measured nothing)."""

    phase: str
    run_bytes: int | None
    probe_bytes: int | None

    @property
    def ratio(self) -> float | None:
        """run / probe; above 1 + PEAK_TOLERANCE, the probe missed something this phase holds."""
        return self.run_bytes / self.probe_bytes if self.run_bytes and self.probe_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "run_peak_reserved_bytes": self.run_bytes,
            "probe_peak_reserved_bytes": self.probe_bytes,
            "run_vs_probe": self.ratio,
        }


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run of `autotune train`: what it trained, where, how far, how fast, in how much memory.

    Figures that follow from others (block size, required bytes, run/probe ratio, perplexity) are
    properties, so that they cannot disagree with what they follow from.
    """

    status: RunEnd
    run_id: int
    study: str
    probe_id: int  # the probe that chose the configuration
    model: str  # the model reference
    weights: str  # where pretrained weights came from, or 'random-init'
    dataset: str
    output_dir: str  # resolved
    device: str  # the study's device name when the run is on its device type
    device_type: str
    config: ProbeConfig
    training_arguments: dict[str, Any]  # the hand-off's TrainingArguments levers
    train_blocks: int
    eval_blocks: int | None
    resumed_from: str | None  # a checkpoint directory
    steps: int  # optimizer steps in all, earlier runs' included
    steps_this_run: int
    max_steps: int | None
    tokens_per_s: float | None  # timed steps only, the first left out
    wall_tokens_per_s: float | None  # over Trainer's whole runtime
    train_seconds: float | None
    seconds: float  # the run, model build and saving included
    budget_bytes: int
    margin_bytes: int
    cap_bytes: int  # what the allocator (or the CPU accountant) could hold
    context_bytes: int
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    probe: ProbeMeasurement
    final_loss: float | None
    eval_loss: float | None
    warnings: tuple[str, ...] = ()
    error: str | None = None  # the error's tail, when the run did not finish
    message: str | None = None  # what the user is told when it ran out of memory
    merged_dir: str | None = None  # --merge: the base with the LoRA adapters merged in, saved whole
    # Each phase's peaks, as a probe's result holds them ({"train": {"allocated": .., "reserved": ..},
    # "eval": ..} or "generate": ..), where the run evaluated; None when it only trained.
    phase_peaks: dict[str, dict[str, int]] | None = None
    failed_phase: str | None = None  # the phase in progress when a run that did not finish stopped, if not train
    # On several ranks: each rank's peaks ({"allocated": .., "reserved": ..} by rank; None for a rank
    # that ended without saying); the peaks above are the largest rank's.
    rank_peaks: list[dict[str, int | None] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.status == RunEnd.FINISHED

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def tokens_per_step(self) -> float:
        return self.config.tokens_per_step

    @property
    def budget(self) -> Budget:
        return Budget(self.budget_bytes, self.margin_bytes)

    @property
    def required_bytes(self) -> int | None:
        """What a card must hold besides the margin: the peak reserved plus the context."""
        return required_bytes(self.peak_reserved_bytes, self.context_bytes)

    @property
    def peak_vs_probe(self) -> float | None:
        if self.peak_reserved_bytes and self.probe.peak_reserved_bytes:
            return self.peak_reserved_bytes / self.probe.peak_reserved_bytes
        return None

    @property
    def phases(self) -> tuple[PhasePeak, ...]:
        """Each phase's peak reserved against its probe's, in the order a run has them, for the phases
        either side ran: () when neither evaluated (the run's peak is then its training's, compared
        by `peak_vs_probe`). A run evaluating without its probe having measured it has its eval row
        with no probe figure; a generating run's evaluation is its generate phase, so the probe's
        eval phase has no run figure."""
        run, probe = self.phase_peaks or {}, self.probe.phase_peaks or {}
        if not run and not probe:
            return ()
        return tuple(
            PhasePeak(phase, run.get(phase, {}).get("reserved"), probe.get(phase, {}).get("reserved"))
            for phase in PHASES
            if phase in run or phase in probe
        )

    @property
    def ranks(self) -> tuple[PhasePeak, ...]:
        """Each rank's peak reserved against its probe's same rank, as rows named 'rank N': () on one GPU."""
        run, probe = self.rank_peaks or [], self.probe.rank_peaks or []
        count = max(len(run), len(probe))
        return tuple(
            PhasePeak(
                f"rank {rank}",
                (run[rank] or {}).get("reserved") if rank < len(run) else None,
                (probe[rank] or {}).get("reserved") if rank < len(probe) else None,
            )
            for rank in range(count)
        )

    @property
    def perplexity(self) -> float | None:
        """exp(eval loss) for the tasks whose loss is per token; a classifier's loss is per sequence."""
        if self.config.task == Task.CLASSIFICATION:
            return None
        loss = self.eval_loss
        return math.exp(loss) if loss is not None and loss < _PERPLEXITY_MAX_LOSS else None

    def with_warnings(self) -> RunSummary:
        """This summary with a warning for each way the run disagrees with its probe or budget."""
        return self.with_memory_warnings()._with_speed_warning()

    def _with_speed_warning(self) -> RunSummary:
        """The run's speed against its probe's, with why when it is more than SPEED_TOLERANCE slower:
        a probe times steps on synthetic batches already on the device; a run's steps also load,
        collate, pad and move real batches, and log; a short run's steps include warm-up."""
        run, probe = self.tokens_per_s, self.probe.tokens_per_s
        if not self.finished or not run or not probe or run >= probe * (1 - SPEED_TOLERANCE):
            return self
        reasons = [
            "its batches are real data, loaded, collated and moved to the device in the step, where the "
            "probe's are synthetic and already there"
        ]
        if self.steps_this_run < FEW_STEPS:
            reasons.append(
                f"it timed {self.steps_this_run} step{'s' if self.steps_this_run != 1 else ''}, whose first "
                f"ones include warm-up"
            )
        if self.config.task in (Task.CLASSIFICATION, Task.SEQ2SEQ) and self.config.lengths is None:
            reasons.append("its examples are padded to the block size as the example scripts pad them")
        if self.eval_blocks:
            reasons.append("evaluation ran beside it")
        # "may": on an H100 the same config's probes varied by up to 25% between processes, and a
        # run 0.62x its probe was within what another probe of the same shape measured
        # (docs/measurements.md, On an H100): none of these is known to be the cause.
        warning = (
            f"the run trained at {run:,.0f} tokens/s, {probe / run:.1f}x below its probe's {probe:,.0f}; "
            f"what the probe does not time may explain it: " + "; ".join(reasons)
        )
        return replace(self, warnings=(*self.warnings, warning))

    def with_memory_warnings(self) -> RunSummary:
        """This summary with a warning for each way the run's memory disagrees with its probe or budget."""
        found = []
        ratio = self.peak_vs_probe
        if ratio is not None and ratio > 1 + PEAK_TOLERANCE and self._eats_into_headroom():
            found.append(
                f"run peak reserved {format_size(self.peak_reserved_bytes)} is {100 * (ratio - 1):.0f}% above the "
                f"probe's {format_size(self.probe.peak_reserved_bytes)}: the run holds something the probe did not "
                f"(evaluation, checkpoint saving, real data); keep the margin in mind"
            )
        required = self.required_bytes
        if self.finished and required is not None and not self.budget.fits(required):
            found.append(
                f"peak reserved + context {format_size(required)} + margin {format_size(self.margin_bytes)} exceed "
                f"the {format_size(self.budget_bytes)} budget: the CUDA context grew during the run"
            )
        return replace(self, warnings=(*self.warnings, *found)) if found else self

    def _eats_into_headroom(self) -> bool:
        """Whether what the run holds beyond its probe takes a real share (a quarter) of the room the
        probe left under the budget: a few MiB more with hundreds to spare is no news."""
        probe_peak = self.probe.peak_reserved_bytes
        if self.peak_reserved_bytes is None or probe_peak is None:
            return False
        room = self.budget.headroom(required_bytes(probe_peak, self.probe.context_bytes or self.context_bytes) or 0)
        return self.peak_reserved_bytes - probe_peak > HEADROOM_SHARE * max(room, 0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, key for key as autotune-run.json has always held it."""
        data: dict[str, Any] = {
            "status": str(self.status),
            "run_id": self.run_id,
            "study": self.study,
            "probe_id": self.probe_id,
            "model": self.model,
            "weights": self.weights,
            "dataset": self.dataset,
            "output_dir": self.output_dir,
            "device": self.device,
            "device_type": self.device_type,
            "config": {**self.config.to_dict(), "label": self.config.label()},
            "training_arguments": dict(self.training_arguments),
            "block_size": self.block_size,
            "tokens_per_step": self.tokens_per_step,
            "train_blocks": self.train_blocks,
            "eval_blocks": self.eval_blocks,
            "resumed_from": self.resumed_from,
            "steps": self.steps,
            "steps_this_run": self.steps_this_run,
            "max_steps": self.max_steps,
            "tokens_per_s": self.tokens_per_s,
            "wall_tokens_per_s": self.wall_tokens_per_s,
            "train_seconds": self.train_seconds,
            "seconds": self.seconds,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "cap_bytes": self.cap_bytes,
            "context_bytes": self.context_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "required_bytes": self.required_bytes,
            "probe": self.probe.to_dict(),
            "peak_vs_probe": self.peak_vs_probe,
            "final_loss": self.final_loss,
            "eval_loss": self.eval_loss,
            "perplexity": self.perplexity,
            "warnings": list(self.warnings),
            "error": self.error,
        }
        if self.message is not None:  # only a run that ran out of memory has one
            data["message"] = self.message
        if self.merged_dir is not None:  # only a LoRA run with --merge has one
            data["merged_dir"] = self.merged_dir
        if self.phases:  # only where the run or its probe evaluated
            data["phase_peaks"] = self.phase_peaks
            data["phases"] = [phase.to_dict() for phase in self.phases]
        if self.failed_phase is not None:  # only a run stopped in its evaluation
            data["failed_phase"] = self.failed_phase
        if self.rank_peaks is not None:  # only a run on several ranks
            data["rank_peaks"] = self.rank_peaks
            data["ranks"] = [rank.to_dict() for rank in self.ranks]
        return data

    def write(self, output_dir: Path) -> Path:
        """Write autotune-run.json into `output_dir`; its path."""
        path = output_dir / SUMMARY_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path
