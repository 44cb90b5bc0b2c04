"""The speed levers (autotune.levers.speed_levers) as a probe and a training run apply them: whether this device
can run each, TF32 switched on or off, Liger's kernels patched in, the model compiled.

Memory on CPU: the accountant (memory.py) is a dispatch mode, and TorchDynamo does not compile
under one; inductor's buffers are also allocated outside the dispatcher. A compiled probe on CPU
therefore accounts its warm-up steps eagerly and compiles after them, before the timed window: its
memory is the eager step's (inductor frees intermediates no later than eager does, so that is an
upper bound), its speed the compiled step's. On CUDA the caching allocator sees everything, and the
compiled steps are both measured and accounted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from autotune.levers import speed_levers
from autotune.levers.config import ProbeConfig


def unavailable(config: ProbeConfig, device: torch.device) -> str | None:
    """Why this device cannot run `config`'s speed levers (the probe is then skipped), or None.
    TF32 is a precision: devices.supports_precision answers for it."""
    if config.allocator != speed_levers.DEFAULT_ALLOCATOR:
        if device.type != "cuda":
            return (
                f"allocator {config.allocator}: a setting of the CUDA caching allocator "
                f"({speed_levers.ALLOC_CONF_VARS[0]}); CPU memory has no such allocator"
            )
        wanted = speed_levers.alloc_conf(config.allocator)
        if wanted and wanted not in speed_levers.effective_alloc_conf(os.environ):
            # The runner starts a child per setting; a child started otherwise must not measure.
            return f"allocator {config.allocator}: this process was not started with {speed_levers.ALLOC_CONF_VARS[0]}={wanted}"
    if config.liger:
        if device.type != "cuda":
            return "liger: Liger's kernels are written in Triton for CUDA devices; none run on CPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger: liger-kernel is not installed (pip install liger-kernel)"
    return None


def use_allocator(allocator: str) -> str | None:
    """Give this process (a training run: `autotune train`) the CUDA allocator setting its probe
    measured, `allocator`; returns what was done, to be said, or None when nothing was. Both
    variable names are set (or, for the default, unset: a user's setting would otherwise run in
    place of the default the probe measured), and where CUDA can be used the setting is also applied
    through the allocator's runtime switch: whether torch read the variables at import or reads them
    when CUDA starts, the run gets the probe's allocator."""
    value = speed_levers.alloc_conf(allocator)
    before = speed_levers.effective_alloc_conf(os.environ)
    for name, setting in speed_levers.allocator_environment(allocator).items():
        if setting is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = setting
    if torch.cuda.is_available():
        with contextlib.suppress(AttributeError, RuntimeError):  # (a private switch: the variables stay)
            torch.cuda.memory._set_allocator_settings(value or "expandable_segments:False")
    if value is not None:
        return f"{speed_levers.ALLOC_CONF_VARS[0]}={value}"
    return (
        f"{speed_levers.ALLOC_CONF_VARS[0]}={before} unset (its probe measured the default allocator)"
        if before
        else None
    )


def set_tf32(config: ProbeConfig) -> None:
    """TF32 matmuls and convolutions for precision tf32 only, as TrainingArguments(tf32=True) sets
    them; off otherwise, PyTorch's default (a warm probe child runs configs of both kinds)."""
    on = config.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def apply_liger(model, model_type: str) -> str | None:
    """Patch Liger's kernels (fused linear + cross-entropy, RMSNorm, RoPE, SwiGLU: Trainer's
    `use_liger_kernel=True` defaults) into `model`, as Trainer does; returns why not, if it cannot."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger: liger-kernel has no kernels for model type {model_type!r}"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    _apply_liger_kernel_to_instance(model=base)
    return None


def compiled(model):
    """`model` compiled with TorchDynamo and inductor, as Trainer's `torch_compile=True` does
    (default backend and mode). Dynamo's caches are cleared first: a warm probe child compiles a
    new model each probe, and past its recompile limit Dynamo would silently run eagerly."""
    torch.compiler.reset()
    return torch.compile(model)


def is_compile_failure(exc: BaseException) -> bool:
    """Whether `exc` came from TorchDynamo or inductor rather than from the step itself."""
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor")) or "BackendCompilerFailed" in type(exc).__name__
