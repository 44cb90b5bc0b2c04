"""What the estimator (parent) and its trace child (`python -m autotune.estimate.trace`) say to
each other: one `TraceRequest` as JSON on the child's stdin; one line per item on its stdout, a
`TraceResult` or, when tracing fails, a `TraceFailure` (after which the child stops).

The answers are marked with a prefix because the child's stdout is shared with whatever torch,
transformers or a model's code print. Torch-free, so both sides import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autotune.levers.config import ProbeConfig
from autotune.estimate.stack import Stack

RESULT_PREFIX = "AUTOTUNE-ESTIMATE-RESULT "
ERROR_PREFIX = "AUTOTUNE-ESTIMATE-ERROR "


@dataclass(frozen=True, slots=True)
class TraceItem:
    """One configuration to trace."""

    config: ProbeConfig
    model_config: dict  # the model's config.json contents
    model_path: str | None = None  # its directory, where there is one
    # The attention implementation to build instead of `config.attention`: kernels without a CPU
    # implementation (flash, flex) are traced as SDPA, which keeps no S x S matrix either.
    trace_attention: str | None = None
    trust_remote_code: bool = False  # the model brings its own code (auto_map) and the user allowed it
    # The run's library versions where they are not the installed ones (estimate/stack.py): the
    # trace makes the installed libraries behave as those did where that changes memory.
    stack: Stack = Stack()

    @property
    def attention(self) -> str:
        """The attention implementation the trace builds."""
        return self.trace_attention or self.config.attention

    def to_dict(self) -> dict:
        data: dict[str, Any] = {
            "config": self.config.to_dict(),
            "model_config": self.model_config,
            "model_path": self.model_path,
        }
        if self.trace_attention is not None:
            data["trace_attention"] = self.trace_attention
        if self.trust_remote_code:
            data["trust_remote_code"] = True
        if self.stack != Stack():
            data["stack"] = self.stack.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TraceItem:
        return cls(
            config=ProbeConfig.from_dict(data["config"]),
            model_config=data["model_config"],
            model_path=data.get("model_path"),
            trace_attention=data.get("trace_attention"),
            trust_remote_code=bool(data.get("trust_remote_code", False)),
            stack=Stack.from_dict(data.get("stack")),
        )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """Trace `items` in order, predicting `device_type` (cuda or cpu)."""

    device_type: str
    items: tuple[TraceItem, ...]

    def to_json(self) -> str:
        return json.dumps({"device_type": self.device_type, "items": [item.to_dict() for item in self.items]})

    @classmethod
    def from_json(cls, text: str) -> TraceRequest:
        data = json.loads(text)
        return cls(device_type=data["device_type"], items=tuple(TraceItem.from_dict(i) for i in data["items"]))


@dataclass(frozen=True, slots=True)
class TraceResult:
    """The replayed trace of item `index`. Sizes in bytes, before the estimator adds what it
    assumes (cuBLAS workspaces, CUDA context)."""

    index: int
    peak_bytes: int  # peak allocated
    breakdown: dict[str, int]  # what was live at the peak, by role; sums to peak_bytes
    peak_phase: str  # where in the step the peak falls
    reserved_bytes: int  # peak reserved: the allocator model's on CUDA, rounded storages on CPU
    segments: int  # cudaMalloc calls the allocator model made (0 on CPU)
    build_seconds: float
    trace_seconds: float
    replay_seconds: float
    events: int  # allocations and frees recorded
    kernels: dict[str, int]  # CUDA kernels emulated, by name, and how often
    torch_version: str
    # Each phase's peaks (autotune.levers.evaluation: train, and eval, generate where the run has them):
    # {"allocated", "reserved"}, each from what was held as the phase began; the peaks above are
    # their largest.
    phase_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    unestimated: dict[str, str] = field(default_factory=dict)  # phases not traced to their end, and why
    # On several GPUs, each rank traced (by number) -> {"allocated", "reserved"} peaks; the peaks
    # above are the largest rank's. Empty on one GPU.
    rank_peaks: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_line(self) -> str:
        return RESULT_PREFIX + json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> TraceResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class TraceFailure:
    """Item `index` could not be traced."""

    index: int
    error_type: str  # the exception's class name
    message: str  # its first line, prefixed with the class name

    def to_line(self) -> str:
        return ERROR_PREFIX + json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> TraceFailure:
        return cls(index=data["index"], error_type=data["error_type"], message=data["message"])


def read_answer(line: str) -> TraceResult | TraceFailure | None:
    """The answer on one line of the child's stdout; None for a line that is not one."""
    if line.startswith(RESULT_PREFIX):
        return TraceResult.from_dict(json.loads(line[len(RESULT_PREFIX) :]))
    if line.startswith(ERROR_PREFIX):
        return TraceFailure.from_dict(json.loads(line[len(ERROR_PREFIX) :]))
    return None
