"""Predict a training configuration's memory without a GPU, before probing it.

`estimate_memory(config)` traces the probe's own build and two optimizer steps (forward,
backward, AdamW step, `zero_grad(set_to_none=True)`; the second copied from the first where it
provably repeats it: trace.py) on fake tensors in a trace child process,
then replays the allocations: the peak allocated and what was live at that moment (parameters,
gradients, optimizer state, activations, temporaries), and, for CUDA, what the caching allocator
would have reserved. Where the run evaluates, the probe's eval (and generate) phases are traced
after the training steps, and each phase's peaks are given (`MemoryEstimate.phase_peaks`); the
peaks are the largest phase's. Nothing is allocated for real.

The modules, parent side: `predict.py` (input checks, `estimate_memory(ies)`), `result.py`
(`MemoryEstimate`, the assumed CUDA figures), `cache.py` (estimates kept on disk), `launch.py`
(running the trace child), `protocol.py` (what parent and child say to each other). Child side:
`trace.py` (the tracing), `cuda.py` (how a CPU trace is made to allocate what a CUDA run
allocates), `generation.py` (generate's value reads, answered), `allocator.py` (the caching
allocator's reserved memory).

Importing this package does not import torch: the search imports it to skip configurations
predicted not to fit and to order probes. `render_estimate` is in `autotune.render.estimate_table`.
"""

from __future__ import annotations

from autotune.estimate.launch import EstimateError
from autotune.estimate.predict import estimate_memories, estimate_memory, untraceable
from autotune.estimate.result import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, DEVICE_TYPES, MemoryEstimate

__all__ = [
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_CONTEXT_BYTES",
    "DEVICE_TYPES",
    "EstimateError",
    "MemoryEstimate",
    "estimate_memories",
    "estimate_memory",
    "untraceable",
]
