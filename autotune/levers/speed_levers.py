"""Speed levers that keep the training's math: torch.compile, TF32 matmuls (a precision, `tf32`),
the CUDA allocator's expandable segments, and Liger's fused kernels (fused linear + cross-entropy).

Unlike the recipe levers (autotune.levers.recipes) these change how fast the same training runs, not what
it trains, so the search may choose among the values the user allows (`--compile off,on`,
`--allocators default,expandable`, `--liger off,on`). Torch-free: the CLI, the store and the
hand-off read these names; `autotune.probe` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping

# The environment variables the CUDA caching allocator reads once, when CUDA initialises: a setting
# needs a process started with it (a probe child, or the training run). torch 2.9 added the
# device-generic PYTORCH_ALLOC_CONF, which wins over the older PYTORCH_CUDA_ALLOC_CONF where both are
# set; autotune sets both to the same value, or unsets both for the default, so that neither a
# user's nor an image's setting of one of them changes what a lever means.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Allocator settings by name: the value of those variables each means (None: both unset).
ALLOCATORS = {
    "default": None,
    # Segments that grow in place instead of new blocks per size: less fragmentation, so reserved
    # memory stays close to allocated (what decides whether a config fits).
    "expandable": "expandable_segments:True",
}
DEFAULT_ALLOCATOR = "default"


def alloc_conf(allocator: str) -> str | None:
    """The allocator setting `allocator` means (None: torch's default, the variables unset)."""
    return ALLOCATORS[allocator]


def allocator_environment(allocator: str) -> dict[str, str | None]:
    """Every allocator variable as a process must start with it for `allocator` (None: unset)."""
    return {name: alloc_conf(allocator) for name in ALLOC_CONF_VARS}


def effective_alloc_conf(environ: Mapping[str, str]) -> str:
    """The setting torch reads from `environ`: the first of ALLOC_CONF_VARS that is set ('' if none)."""
    return next((environ[name] for name in ALLOC_CONF_VARS if name in environ), "")


def environment_line(allocator: str) -> str | None:
    """The shell line a training run must be started under, or None when it needs none."""
    value = alloc_conf(allocator)
    return None if value is None else "export " + " ".join(f"{name}={value}" for name in ALLOC_CONF_VARS)
