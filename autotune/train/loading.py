"""The model to train: where the weights are, and the model of the winner's task built from them
(the tokenizer that encodes the data: autotune.data.tokenizer). transformers is imported inside the
functions that need it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.data.tokenizer import hub_usable
from autotune.specs.models import WEIGHT_FILES

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from autotune.levers.config import ProbeConfig
    from autotune.specs.models import ModelSpec
    from autotune.data.task_data import Labels


def weights_location(spec: ModelSpec, random_init: bool = False) -> str | None:
    """Where pretrained weights can be loaded from, or None for a random initialisation."""
    if random_init:
        return None
    if spec.path and any((Path(spec.path) / name).is_file() for name in WEIGHT_FILES):
        return spec.path
    if spec.source == "hub" and hub_usable():
        return spec.reference  # from_pretrained downloads them
    return None


def build_model(
    spec: ModelSpec,
    config: ProbeConfig,
    device: torch.device,
    weights: str | None,
    trust_remote_code: bool = False,
    labels: Labels | None = None,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """The model of `config.task` (the class the probe built) to train, as the probe built it: in
    fp32 (mixed precision keeps fp32 master weights), or in bf16 for pure bf16 (`weights` bf16);
    with LoRA adapters on its frozen base when `config.peft` (a peft.PeftModel, which answers as
    the model it wraps), the base's linear layers in 4 bits for QLoRA. A classifier gets the data's `labels`
    and, where its config has none, the tokenizer's `pad_token_id` (decoder classifiers find each
    sequence's last token by it)."""
    import torch
    from transformers import AutoConfig, BitsAndBytesConfig

    from autotune.probe.step import auto_class, from_config, task_config, weights_dtype, with_adapters
    from autotune.levers.recipes import bnb_4bit_kwargs, is_qlora
    from autotune.levers.tasks import Task

    if weights is not None:
        hf_config = AutoConfig.from_pretrained(weights, trust_remote_code=trust_remote_code)
    else:
        hf_config = spec.hf_config(trust_remote_code)
    if config.task == Task.CLASSIFICATION and getattr(hf_config, "pad_token_id", None) is None:
        hf_config.pad_token_id = pad_token_id
    task_config(hf_config, config)  # use_cache off; the probe's head size, and a pad token for classifiers
    if labels is not None:
        hf_config.num_labels = labels.count
        id2label = labels.id2label()
        if id2label is not None:
            hf_config.id2label, hf_config.label2id = id2label, {name: i for i, name in id2label.items()}
        if labels.regression:
            hf_config.problem_type = "regression"
    dtype = weights_dtype(config)
    if weights is not None:
        # A checkpoint's classifier of another size is replaced by a new one (run_classification.py's
        # --ignore_mismatched_sizes); the body's weights load.
        extra: dict[str, Any] = {"ignore_mismatched_sizes": True} if config.task == Task.CLASSIFICATION else {}
        if is_qlora(config.peft):  # quantized as each weight arrives, onto the device it trains on
            extra.update(
                quantization_config=BitsAndBytesConfig(**bnb_4bit_kwargs(config.precision, config.task)),
                device_map={"": device},
            )
        model = auto_class(config.task).from_pretrained(
            weights,
            config=hf_config,
            attn_implementation=config.attention,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **extra,
        )
    elif is_qlora(config.peft):
        from autotune.probe.qlora import build_4bit

        model = build_4bit(
            lambda: from_config(hf_config, config, trust_remote_code, dtype=dtype), config, device, dtype
        )
    else:
        with torch.device(device):  # built where it trains: no host copy of a large model
            model = from_config(hf_config, config, trust_remote_code, dtype=dtype)
    if config.peft is None:
        return model  # Trainer turns checkpointing on from its arguments
    if config.checkpointing:
        # The probe's order: checkpointing on the base, then the adapters (peft, seeing it, makes the
        # embeddings' output require grad, which a frozen base needs under reentrant checkpointing).
        # Trainer turning it on again from its arguments changes nothing.
        enable_checkpointing(model)
    return with_adapters(model, config)


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing, as the probe and Trainer's arguments have it."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def check_weights(spec: ModelSpec, random_init: bool = False) -> None:
    """BadInput unless each of the model's safetensors files has a readable header (its 8-byte length,
    then that much JSON, within the file): a truncated or corrupt download is refused before anything
    is searched or recorded, not found when the run loads it. Cheap: headers only."""
    import json
    import struct
    from pathlib import Path

    from autotune.vocabulary.errors import BadInput

    location = weights_location(spec, random_init)
    if location is None or not Path(location).is_dir():
        return
    for path in sorted(Path(location).glob("*.safetensors")):
        try:
            size = path.stat().st_size
            with open(path, "rb") as source:
                head = source.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 2 <= length <= min(size - 8, 100 << 20):
                    raise ValueError(f"a header of {length} bytes in a file of {size}")
                header = json.loads(source.read(length))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise BadInput(
                f"--model {spec.reference}: {path.name} is not a readable safetensors file ({exc}); "
                f"download the weights again, or pass --random-init to train from random weights."
            ) from None
