"""The CUDA figures the estimator assumes rather than traces: the memory a CUDA process holds outside
PyTorch's allocator (the context with its loaded kernels), and cuBLAS's workspaces (taken from the
caching allocator, so counted as allocated). Their values live in cuda_constants.json beside this
file, each with where it came from: "assumed ..." until `python -m benchmarks.gpu_evidence` measures
it on a card and records it here (`record_measured`), which is then committed with the evidence.

Torch-free: the estimator's parent, the planner and the card list read these figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FILE = Path(__file__).with_name("cuda_constants.json")
CONTEXT = "context_bytes"
CUBLAS_WORKSPACES = "cublas_workspace_bytes"
NAMES = (CONTEXT, CUBLAS_WORKSPACES)


@dataclass(frozen=True, slots=True)
class CudaConstant:
    """One figure in bytes and where it came from ("assumed: why", or "measured on DEVICE ...")."""

    bytes: int
    source: str

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


def load(path: Path = FILE) -> dict[str, CudaConstant]:
    """Every figure, by name."""
    data = json.loads(path.read_text())
    return {name: CudaConstant(int(data[name]["bytes"]), str(data[name]["source"])) for name in NAMES}


def record_measured(name: str, value_bytes: int, where: str, path: Path = FILE) -> None:
    """Record `name` as measured (`where`: the device, driver, torch version and date it was
    measured with), keeping the other figures as they are."""
    if name not in NAMES:
        raise KeyError(f"no CUDA constant {name!r}; the estimator reads {', '.join(NAMES)}")
    data = json.loads(path.read_text())
    data[name] = {"bytes": int(value_bytes), "source": f"measured on {where}"}
    path.write_text(json.dumps(data, indent=2) + "\n")
