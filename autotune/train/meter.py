"""`RunMeter`, the Trainer callback that measures a run, and the Trainers that tell it when an
evaluation starts and ends. It subclasses transformers' classes, so this module imports
transformers: only `autotune.train.run` imports it, and only once a run starts.

A run's memory is measured per phase, as a probe's is (autotune.probe.child): the training steps,
and the evaluation (`eval`, or `generate` where Seq2SeqTrainer generates in it). The peaks start over
from what is held when an evaluation starts and when it ends, so that each phase's peak is its own
(the training state resident in every phase); a phase met again (Trainer evaluates every
eval_steps and at the end) keeps the largest of its peaks. The run's peak is the largest phase's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from autotune.vocabulary.defaults import WARMUP_STEPS
from autotune.levers.evaluation import EVAL, TRAIN

if TYPE_CHECKING:
    from autotune.probe.cap import MemoryCap


class RunMeter(TrainerCallback):
    """Times each optimizer step (synchronised on CUDA), follows the loss, reads the peaks. On CPU
    the accountant watches the first WARMUP_STEPS optimizer steps: as in a probe's warm-up, they
    bring weights, gradients, optimizer state and activations to their steady size, and every later
    step repeats them. It slows a step by about 40%, and the probe times its window without it: so
    the run's later steps go without it too, and each evaluation is watched again."""

    def __init__(
        self, budget: MemoryCap, tokens_per_step: float, echo: Callable[[str], None] | None, eval_phase: str = EVAL
    ) -> None:
        self.budget, self.tokens_per_step, self.echo = budget, tokens_per_step, echo
        self.eval_phase = eval_phase  # what an evaluation of this run is: eval, or generate
        self.step_seconds: list[float] = []
        self.first_step: int | None = None
        self.last_loss: float | None = None
        self.eval_loss: float | None = None
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None
        self.phase = TRAIN  # the phase in progress
        self.failed_phase: str | None = None  # the phase an exception left (an OOM's), when not training
        self.evaluated_at: int | None = None  # the optimizer step of the latest evaluation
        self._phase_peaks: dict[str, tuple[int, int]] = {}
        self._started = 0.0

    def _sync(self) -> None:
        if self.budget.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.budget.device)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.first_step is None:
            self.first_step = state.global_step
        self._sync()
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self.step_seconds.append(time.perf_counter() - self._started)
        self.read_peaks()
        if self.budget.accountant is not None and len(self.step_seconds) >= WARMUP_STEPS:
            self.budget.accountant.suspend()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        if "loss" in logs:
            self.last_loss = float(logs["loss"])
        if "eval_loss" in logs:
            self.eval_loss = float(logs["eval_loss"])
        if self.echo is not None:
            shown = {k: v for k, v in logs.items() if k != "total_flos"}
            parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()]
            self.echo(f"step {state.global_step}/{state.max_steps}: {', '.join(parts)}")

    def read_peaks(self) -> None:
        """Fold the peaks since the phase began (or last started over) into its own, and the run's."""
        allocated, reserved = self.budget.peaks()
        if allocated is None or reserved is None:
            return
        before = self._phase_peaks.get(self.phase, (0, 0))
        self._phase_peaks[self.phase] = (max(before[0], allocated), max(before[1], reserved))
        self.peak_allocated = max(peak[0] for peak in self._phase_peaks.values())
        self.peak_reserved = max(peak[1] for peak in self._phase_peaks.values())

    @contextlib.contextmanager
    def evaluating(self, step: int) -> Iterator[None]:
        """An evaluation at optimizer step `step`: its peaks are the eval phase's (or generate's)."""
        accountant = self.budget.accountant
        suspended = accountant is not None and not accountant.watching
        if suspended and accountant is not None:
            accountant.resume()  # (an evaluation is not a repeat of the steps the accountant saw)
        self._begin(self.eval_phase)
        try:
            with self._host_arrays_apart():
                yield
        except BaseException:
            # The run stops here: what its exception still holds stays the evaluation's.
            self.failed_phase = self.eval_phase
            self.read_peaks()
            raise
        finally:
            if suspended and accountant is not None:
                accountant.suspend()
        self._begin(TRAIN)
        self.evaluated_at = step

    @contextlib.contextmanager
    def _host_arrays_apart(self) -> Iterator[None]:
        """On CPU, what Trainer moves to the host is copied out of the accounted memory. Every
        eval_accumulation_steps batches Trainer moves the kept logits off the card into numpy arrays
        (`nested_numpify`: `.cpu().numpy()`); on a CPU device `.cpu()` is the tensor itself and the
        array shares its storage, which the CPU accountant (the card it emulates) would go on
        counting with each later batch: host memory that no card holds, and its probe never counted
        (measured on a tiny GPT-2 keeping 2 batches: +25% eval peak). A copy leaves the card's
        figure what a card's would be. On CUDA nothing changes."""
        if self.budget.accountant is None:
            yield
            return
        import numpy as np
        from transformers import trainer_pt_utils

        numpify = trainer_pt_utils.nested_numpify

        def copy(arrays: Any) -> Any:
            if isinstance(arrays, (list, tuple)):
                return type(arrays)(copy(a) for a in arrays)
            if isinstance(arrays, dict):
                return type(arrays)({k: copy(a) for k, a in arrays.items()})
            return np.array(arrays, copy=True)

        trainer_pt_utils.nested_numpify = lambda tensors: copy(numpify(tensors))
        try:
            yield
        finally:
            trainer_pt_utils.nested_numpify = numpify

    def _begin(self, phase: str) -> None:
        self.read_peaks()
        self.budget.reset_peaks()
        self.phase = phase

    @property
    def phase_peaks(self) -> dict[str, dict[str, int]] | None:
        """Each phase's peaks, as a probe's result holds them ({"train": {"allocated": .., "reserved":
        ..}, "eval": ..}); None for a run that did not evaluate (its peaks are the training's)."""
        if set(self._phase_peaks) <= {TRAIN}:
            return None
        return {
            phase: {"allocated": allocated, "reserved": reserved}
            for phase, (allocated, reserved) in self._phase_peaks.items()
        }

    @property
    def steps(self) -> int:
        """Optimizer steps this run timed."""
        return len(self.step_seconds)

    @property
    def tokens_per_s(self) -> float | None:
        # The first step creates the optimizer state and loads kernels: leave it out when others ran.
        window = self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds
        return self.tokens_per_step * len(window) / sum(window) if window and sum(window) > 0 else None


class _MeteredEvaluation:
    """Tells the run's meter when each evaluation starts and ends (Trainer has a callback for its
    end only, after the memory of its first batches went by)."""

    meter: RunMeter
    state: Any

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self.meter.evaluating(self.state.global_step):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]


class MeteredTrainer(_MeteredEvaluation, Trainer):
    def __init__(self, *, meter: RunMeter, **kwargs: Any) -> None:
        super().__init__(callbacks=[meter], **kwargs)
        self.meter = meter


class MeteredSeq2SeqTrainer(_MeteredEvaluation, Seq2SeqTrainer):
    """For a run whose evaluation generates (Seq2SeqTrainingArguments' predict_with_generate)."""

    def __init__(self, *, meter: RunMeter, **kwargs: Any) -> None:
        super().__init__(callbacks=[meter], **kwargs)
        self.meter = meter
