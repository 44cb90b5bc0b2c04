"""QLoRA's frozen base: the model's linear layers in 4 bits (bitsandbytes NF4 with double
quantization), the layers transformers keeps whole (the output embeddings, tied weights) and every
other parameter in the weights' dtype; as `from_pretrained(..., quantization_config=
BitsAndBytesConfig(**autotune.levers.recipes.bnb_4bit_kwargs(...)), dtype=...)` loads a checkpoint, but
built from the config alone with random values (memory and speed do not depend on them).

Why not build the model whole and quantize it after: its unquantized weights would all be on the
device at once (a 7B model in bf16, 13.5 GB, on the 24 GB card QLoRA is for), and the probe counts
its build. transformers' own loader quantizes each weight as it arrives; so does this build. The
parameters are first made on the meta device (shapes only; buffers are made for real, their values
come from the config: rotary frequencies), transformers' `replace_with_bnb_linear` swaps the linear
layers for bitsandbytes' `Linear4bit`, and then each parameter is made on the device in turn, a
linear layer's weight quantized as soon as it exists.
"""

from __future__ import annotations

import contextlib

import torch

from autotune.levers.config import ProbeConfig
from autotune.levers.recipes import bnb_4bit_kwargs

BLOCK_SIZE = 64  # values per absmax statistic (Params4bit's default, as from_pretrained quantizes)


def import_quantizer() -> None:
    """Import what quantizing imports, and make bitsandbytes' 8-bit map for the statistics (made
    once per process on first use, from Python lists): before a probe's accountant or the
    estimator's ledger counts, so that it is no probe's (and the ledger's fake tensors, which
    cannot be read, need not make it)."""
    import bitsandbytes.functional
    import transformers.integrations.bitsandbytes
    import transformers.quantizers.base  # noqa: F401

    bitsandbytes.functional.name2qmap.setdefault("dynamic", bitsandbytes.functional.create_dynamic_map())


def build_4bit(build, config: ProbeConfig, device: torch.device, dtype: torch.dtype):
    """The model `build()` makes (under `torch.device(device)`, parameters in `dtype`), with its
    linear layers in 4 bits on `device`."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    with _parameters_on_meta(), torch.device(device):
        model = build()
    quantization = BitsAndBytesConfig(**bnb_4bit_kwargs(config.precision, config.task))
    # What transformers' 4-bit quantizer keeps whole (HfQuantizer.get_modules_to_not_convert): the
    # skip list, else the output embeddings, tied weights and the last module; and the model's own
    # fp32 modules.
    skip = quantization.llm_int8_skip_modules
    keep = [
        *(get_keys_to_not_convert(model) if skip is None else skip),
        *(getattr(model, "_keep_in_fp32_modules", None) or []),
    ]
    # Linear4bit's weight is a Params4bit over a meta tensor, which cannot be made over a fake one:
    # in the estimator's trace, the new layers' (shape-only) parameters are made outside it.
    with unset_fake_temporarily():
        replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=quantization)
    std = getattr(model.config, "initializer_range", None) or 0.02
    made: dict[int, torch.nn.Parameter] = {}  # meta parameter -> real one: tied weights stay one parameter
    for module in model.modules():
        for name, meta in list(module._parameters.items()):
            if meta is None or not meta.is_meta:
                continue
            real = made.get(id(meta))
            if real is None:
                if isinstance(module, bnb.nn.Linear4bit) and name == "weight":
                    real = _in_4_bits(
                        torch.empty(meta.shape, dtype=dtype, device=device).normal_(0.0, std), module, quantization
                    )
                else:
                    real = torch.nn.Parameter(
                        _initial(name, meta.shape, dtype, device, std), requires_grad=meta.requires_grad
                    )
                made[id(meta)] = real
            module._parameters[name] = real
    # As transformers marks a model it loaded in 4 bits: peft reads it to wrap Linear4bit layers.
    model.is_loaded_in_4bit = True
    return model


def _in_4_bits(values: torch.Tensor, module, quantization) -> torch.nn.Parameter:
    """`values` quantized, as bitsandbytes' `Params4bit` holds a loaded weight: the packed 4-bit
    values and their quantization statistics (`quant_state`, also on the module).

    In the estimator's trace `values` is a fake tensor, which `Params4bit` (a tensor subclass)
    cannot wrap; there the same `quantize_4bit` call fills a plain parameter carrying the
    attributes Linear4bit and peft read, so the trace allocates what the probe does."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import is_fake

    how = {
        "blocksize": BLOCK_SIZE,
        "compress_statistics": quantization.bnb_4bit_use_double_quant,
        "quant_type": quantization.bnb_4bit_quant_type,
        "quant_storage": torch.uint8,
    }
    if not is_fake(values):
        return bnb.nn.Params4bit(values, requires_grad=False, module=module, **how).to(values.device)  # type: ignore[misc]  # (quantizes)
    packed, state = bnb.functional.quantize_4bit(values, **how)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    for name, value in {**how, "quant_state": state, "bnb_quantized": True, "module": module}.items():
        setattr(weight, name, value)
    module.quant_state = state
    return weight


def _initial(name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, std: float) -> torch.Tensor:
    """Values as an initialisation would give them in kind: matrices and embeddings small and
    random, norms' scales one, biases zero (so the loss is an ordinary, finite one)."""
    if len(shape) > 1:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)
    return (torch.zeros if name == "bias" else torch.ones)(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered meanwhile moves to the meta device as it is registered (one
    layer's parameters exist for real at a time, briefly); buffers stay real. accelerate's
    `init_empty_weights(include_buffers=False)` does the same; accelerate is not a dependency."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # (a tied weight registered again stays the same object)
            # (a parameter over a fake tensor, in the estimator's trace, is of the fake tensor's type)
            kind = type(param) if issubclass(type(param), torch.nn.Parameter) else torch.nn.Parameter
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
