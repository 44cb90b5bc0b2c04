"""How a probe child runs the run's later phases and accounts for each: every phase's peaks its
own (the peaks start over from what is held as a phase begins, as torch.cuda.reset_peak_memory_stats
does), the probe's peak the largest of them, and with `--eval-batch auto` the largest eval batch
whose phases all fit. What each phase runs is probe/phases.py's (traced by the estimator too)."""

from __future__ import annotations

import gc
from collections.abc import Callable

from autotune.levers import evaluation
from autotune.results.budget import Budget, required_bytes
from autotune.probe.cap import MemoryCap
from autotune.probe.oom import classify_exception
from autotune.probe.phases import LaterPhases
from autotune.probe.step import ProbeStep
from autotune.vocabulary.status import ProbeStatus


class PhaseMeter:
    """The phase in progress (None once all ended) and the peaks of each phase ended."""

    def __init__(self, cap: MemoryCap) -> None:
        self.cap = cap
        self.phase: str | None = evaluation.TRAIN
        self.peaks: dict[str, dict[str, int]] = {}

    def begin(self, phase: str) -> None:
        self.end()
        self.phase = phase

    def end(self) -> None:
        """Record the phase in progress's peaks, and start the next phase's from what is held now."""
        allocated, reserved = self.cap.peaks()
        if self.phase is not None and allocated is not None and reserved is not None:
            self.peaks[self.phase] = {"allocated": allocated, "reserved": reserved}
        self.cap.reset_peaks()

    def finish(self) -> None:
        self.end()
        self.phase = None

    def largest(self) -> tuple[int | None, int | None]:
        """The largest allocated and reserved peaks over the phases (None before any ended)."""
        if not self.peaks:
            return None, None
        return (max(p["allocated"] for p in self.peaks.values()), max(p["reserved"] for p in self.peaks.values()))


class LaterPhaseRun:
    """The evaluation (and generation) after a probe's training steps, as Trainer runs them between
    optimizer steps: the training state resident, each phase metered."""

    def __init__(
        self,
        step: ProbeStep,
        vocab_size: int,
        meter: PhaseMeter,
        report: Callable[[str], None],
        synchronize: Callable[[], None],
    ) -> None:
        self.step, self.vocab_size, self.meter = step, vocab_size, meter
        self.report, self.synchronize = report, synchronize
        self.config = step.config
        self.caught_oom = False  # an OOM was caught and the probe went on (--eval-batch auto)

    def run(self, budget: Budget) -> int | None:
        """Run the phases; with --eval-batch auto, returns the eval batch found (else None)."""
        if self.config.auto_eval_batch:
            return self._find_eval_batch(budget)
        self._run_at(self.config.eval_batch)
        return None

    def _run_at(self, eval_batch: int | None) -> None:
        phases = LaterPhases(self.step, self.vocab_size, eval_batch)
        for phase, run in ((evaluation.EVAL, phases.evaluate), (evaluation.GENERATE, phases.generate)):
            if phase in evaluation.phases(self.config):
                self.meter.begin(phase)
                self.report(phase)
                run()
                self.synchronize()
        self.meter.finish()

    def _find_eval_batch(self, budget: Budget) -> int | None:
        """Run the phases at eval batches 1, 2, 4, ... up to the config's, and keep the largest whose
        every phase fits the budget (peak reserved + context + margin), with its peaks: one probe
        finds what a search over eval batches would, since the training state is the same for all.
        An OOM ends the doubling; at eval batch 1 it is the probe's (the phase does not fit at all).
        On CUDA the process is not reused after an OOM it caught (the allocator's cache is fragmented)."""
        found, kept = None, dict(self.meter.peaks)
        for size in evaluation.auto_eval_batches(self.config):
            try:
                self._run_at(size)
            except Exception as exc:
                if classify_exception(exc) != ProbeStatus.OOM or found is None:
                    raise
                del exc  # (its traceback holds the failed attempt's tensors)
                self.caught_oom = True
                break
            context = self.meter.cap.context_now()
            later = [peaks for phase, peaks in self.meter.peaks.items() if phase != evaluation.TRAIN]
            if not all(budget.fits(required_bytes(peaks["reserved"], context) or 0) for peaks in later):
                if found is None:
                    return None  # (the probe's judgement names the phase over the budget)
                break
            found, kept = size, dict(self.meter.peaks)
        gc.collect()
        self.meter.peaks, self.meter.phase = kept, None  # the found batch's peaks; no phase in progress
        return found
