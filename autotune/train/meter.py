"""`RunMeter`, the Trainer callback that measures a run. It subclasses transformers'
TrainerCallback, so this module imports transformers: only `autotune.train.run` imports it, and
only once a run starts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    from autotune.probe.cap import MemoryCap


class RunMeter(TrainerCallback):
    """Times each optimizer step (synchronised on CUDA), follows the loss, reads the peaks."""

    def __init__(self, budget: MemoryCap, tokens_per_step: int, echo: Callable[[str], None] | None) -> None:
        self.budget, self.tokens_per_step, self.echo = budget, tokens_per_step, echo
        self.step_seconds: list[float] = []
        self.first_step: int | None = None
        self.last_loss: float | None = None
        self.eval_loss: float | None = None
        self.peak_allocated: int | None = None
        self.peak_reserved: int | None = None
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
        self.peak_allocated, self.peak_reserved = self.budget.peaks()

    @property
    def steps(self) -> int:
        """Optimizer steps this run timed."""
        return len(self.step_seconds)

    @property
    def tokens_per_s(self) -> float | None:
        # The first step creates the optimizer state and loads kernels: leave it out when others ran.
        window = self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds
        return self.tokens_per_step * len(window) / sum(window) if window and sum(window) > 0 else None
