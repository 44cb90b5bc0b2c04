"""What the estimator answers: `MemoryEstimate`, and the CUDA figures it assumes rather than traces."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.config import ProbeConfig
from autotune.units import CUDA_BLOCK_BYTES

DEVICE_TYPES = ("cuda", "cpu")
# Memory a CUDA process holds outside PyTorch's allocator: the context with its loaded kernels
# (0.3-0.7 GiB depending on driver, card and libraries; DESIGN.md). Assumed, not measured: a probe
# measures the real figure on its card. 0 on CPU.
CUDA_CONTEXT_BYTES = 500 * 2**20
# cuBLAS workspaces, taken from the caching allocator and held for the whole run, so they count as
# allocated: one per (thread, stream) that runs matmuls, i.e. the training thread and autograd's
# device thread; 32 MiB each on Hopper and later (torch's default CUBLAS_WORKSPACE_CONFIG, 8 MiB +
# 128 KiB on older cards).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20

RESERVED_METHOD = {
    "cuda": "CUDA caching allocator replayed over the traced allocations (default settings, one stream)",
    "cpu": f"each storage rounded up to {CUDA_BLOCK_BYTES} bytes, as the probe's CPU accountant counts",
}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted memory of one configuration on one device type. Sizes in bytes.

    `params + grads + optimizer + activations + temporaries + workspace == peak_bytes`: what was
    live at the moment of the peak. `reserved_bytes` is what the allocator would hold at its peak
    (`torch.cuda.max_memory_reserved()`); `context_bytes` what the process needs outside it.
    """

    config: ProbeConfig
    device_type: str
    params: int
    grads: int
    optimizer: int
    activations: int
    temporaries: int
    workspace: int
    peak_bytes: int
    reserved_bytes: int
    context_bytes: int
    seconds: float                 # wall time of this call (near 0 when cached)
    trace_seconds: float = 0.0     # wall time of the trace that produced it
    peak_phase: str = ""           # where in the step the peak falls: forward, backward, optimizer step
    cached: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries, "workspace": self.workspace}

    @property
    def required_bytes(self) -> int:
        """What the configuration needs of the card: peak reserved plus the context."""
        return self.reserved_bytes + self.context_bytes

    @property
    def reserved_method(self) -> str:
        return RESERVED_METHOD[self.device_type]

    def headroom(self, budget_bytes: int, margin_bytes: int = 0) -> int:
        """Bytes to spare within the budget after the margin; negative when over."""
        return budget_bytes - margin_bytes - self.required_bytes

    def fits(self, budget_bytes: int, margin_bytes: int = 0) -> bool:
        """True if peak reserved + context + margin is within the budget (the probe's rule)."""
        return self.headroom(budget_bytes, margin_bytes) >= 0

    def exceeds(self, budget_bytes: int, by_more_than: int = 0) -> bool:
        """True if even the peak *allocated* plus the context is over the budget by more than
        `by_more_than` bytes: the test for skipping a configuration without probing it. Allocated
        memory is a floor (under a cap the allocator frees cached blocks before it fails, so the
        reserved figure, measured uncapped, can shrink; the allocated one cannot)."""
        return self.peak_bytes + self.context_bytes - budget_bytes > by_more_than

    def to_dict(self, budget_bytes: int | None = None, margin_bytes: int = 0) -> dict:
        data = {
            "model": self.config.model,
            "config": self.config.to_dict(),
            "device_type": self.device_type,
            "peak_bytes": self.peak_bytes,
            "breakdown": self.breakdown,
            "reserved_bytes": self.reserved_bytes,
            "reserved_method": self.reserved_method,
            "context_bytes": self.context_bytes,
            "required_bytes": self.required_bytes,
            "peak_phase": self.peak_phase,
            "seconds": round(self.seconds, 3),
            "trace_seconds": round(self.trace_seconds, 3),
            "cached": self.cached,
            "notes": list(self.notes),
        }
        if budget_bytes is not None:
            data.update(budget_bytes=budget_bytes, margin_bytes=margin_bytes, fits=self.fits(budget_bytes, margin_bytes),
                        headroom_bytes=self.headroom(budget_bytes, margin_bytes))
        return data
