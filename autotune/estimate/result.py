"""What the estimator answers: `MemoryEstimate`, and the CUDA figures it assumes rather than traces."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.results.budget import Budget, required_bytes
from autotune.levers.config import ProbeConfig
import autotune.estimate.cuda_constants as cuda_constants
import autotune.estimate.stated_error as stated_error
from autotune.vocabulary.units import CUDA_BLOCK_BYTES

DEVICE_TYPES = ("cuda", "cpu")
# Memory a CUDA process holds outside PyTorch's allocator (the context with its loaded kernels), and
# cuBLAS's workspaces, taken from the caching allocator and held for the whole run (so counted as
# allocated): assumed, or measured on a card (estimate/cuda_constants.py says which). 0 on CPU.
CUDA_CONSTANTS = cuda_constants.load()
CUDA_CONTEXT_BYTES = CUDA_CONSTANTS[cuda_constants.CONTEXT].bytes
CUBLAS_WORKSPACE_BYTES = CUDA_CONSTANTS[cuda_constants.CUBLAS_WORKSPACES].bytes

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

    `phase_peaks` has each phase of the run the probe measures (autotune.levers.evaluation: "train", and
    "eval", "generate" where the run has them) as {"allocated", "reserved"}, in the form of
    ProbeResult.phase_peaks: each phase's peaks from what was held as it began, the training state
    resident in all. `peak_bytes` and `reserved_bytes` are their largest. A phase in
    `unestimated_phases` (with why) could not be traced: it is in neither.
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
    seconds: float  # wall time of this call (near 0 when cached)
    trace_seconds: float = 0.0  # wall time of the trace that produced it
    peak_phase: str = ""  # where in the step the peak falls: forward, backward, optimizer step
    cached: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    phase_peaks: dict[str, dict[str, int]] = field(default_factory=dict, hash=False)
    unestimated_phases: dict[str, str] = field(default_factory=dict, hash=False)
    # On several GPUs (config.ranks > 1) every figure above is one rank's, the largest's; each rank
    # traced by number -> {"allocated", "reserved"} (ranks not traced hold what one of these holds).
    rank_peaks: dict[str, dict[str, int]] = field(default_factory=dict, hash=False)

    @property
    def per_rank(self) -> bool:
        return self.config.ranks > 1

    @property
    def breakdown(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "temporaries": self.temporaries,
            "workspace": self.workspace,
        }

    @property
    def required_bytes(self) -> int:
        """What the configuration needs of the card: peak reserved plus the context."""
        return required_bytes(self.reserved_bytes, self.context_bytes) or 0

    def phase_required_bytes(self, phase: str) -> int | None:
        """What `phase` needs of the card: its peak reserved plus the context (None: not estimated)."""
        peaks = self.phase_peaks.get(phase)
        return None if peaks is None else required_bytes(peaks["reserved"], self.context_bytes)

    @property
    def reserved_method(self) -> str:
        return RESERVED_METHOD[self.device_type]

    @property
    def floor_bytes(self) -> int:
        """The least the configuration needs: peak *allocated* plus the context. Under a cap the
        allocator frees cached blocks before it fails, so the reserved figure (traced uncapped) can
        shrink; the allocated one cannot. A search skips a config unprobed only on this."""
        return self.peak_bytes + self.context_bytes

    def stated_errors(self) -> dict[str, stated_error.StatedError]:
        """How far predictions of this kind were from published GPU measurements, by kind of figure
        (allocated, reserved, nvidia-smi: reserved + context); none for a CPU prediction, which
        equals the CPU probe to the byte."""
        if self.device_type != "cuda":
            return {}
        errors = stated_error.load()
        found = {kind: stated_error.stated(kind, self.config.peft, errors) for kind in stated_error.KINDS}
        return {kind: error for kind, error in found.items() if error is not None}

    def to_dict(self, budget: Budget | None = None) -> dict:
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
            "phase_peaks": {phase: dict(peaks) for phase, peaks in self.phase_peaks.items()},
            "gpus": self.config.gpus,
            "nodes": self.config.nodes,
            "strategy": self.config.strategy,
            "per_rank": self.per_rank,
            "rank_peaks": {rank: dict(peaks) for rank, peaks in self.rank_peaks.items()},
            "unestimated_phases": dict(self.unestimated_phases),
            "seconds": round(self.seconds, 3),
            "trace_seconds": round(self.trace_seconds, 3),
            "cached": self.cached,
            "notes": list(self.notes),
            "stated_error": {
                kind: {"method": e.method, "count": e.count, "median": e.median, "worst": e.worst}
                for kind, e in self.stated_errors().items()
            },
        }
        if budget is not None:
            data.update(
                budget_bytes=budget.total_bytes,
                margin_bytes=budget.margin_bytes,
                fits=budget.fits(self.required_bytes),
                headroom_bytes=budget.headroom(self.required_bytes),
            )
        return data
