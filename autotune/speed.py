"""Speed levers that keep the training's math: torch.compile, TF32 matmuls (a precision, `tf32`),
the CUDA allocator's expandable segments, and Liger's fused kernels (fused linear + cross-entropy).

Unlike the recipe levers (autotune.recipes) these change how fast the same training runs, not what
it trains, so the search may choose among the values the user allows (`--compile off,on`,
`--allocators default,expandable`, `--liger off,on`). Torch-free: the CLI, the store and the
hand-off read these names; `autotune.probe` applies them.
"""

from __future__ import annotations

# The environment variable the CUDA caching allocator reads once, when CUDA initialises: a setting
# needs a process started with it (a probe child, or the training run).
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
# Allocator settings by name: the value of ALLOC_CONF_VAR each means (None: the variable unset).
ALLOCATORS = {
    "default": None,
    # Segments that grow in place instead of new blocks per size: less fragmentation, so reserved
    # memory stays close to allocated (what decides whether a config fits).
    "expandable": "expandable_segments:True",
}
DEFAULT_ALLOCATOR = "default"


def alloc_conf(allocator: str) -> str | None:
    """The value of PYTORCH_CUDA_ALLOC_CONF that `allocator` means (None: leave it unset)."""
    return ALLOCATORS[allocator]


def environment_line(allocator: str) -> str | None:
    """The shell line a training run must be started under, or None when it needs none."""
    value = alloc_conf(allocator)
    return None if value is None else f"export {ALLOC_CONF_VAR}={value}"
