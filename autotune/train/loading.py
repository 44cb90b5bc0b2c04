"""The model and tokenizer to train: where the weights are, which tokenizer encodes the data, and
the model of the winner's task built from them. transformers is imported inside the functions that
need it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import BadInput, ModelNotFound

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from autotune.config import ProbeConfig
    from autotune.models import ModelSpec
    from autotune.train.task_data import Labels

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _hub_usable() -> bool:
    from autotune.models import _hub_reachable, _offline

    return not _offline() and _hub_reachable()


def weights_location(spec: ModelSpec, random_init: bool = False) -> str | None:
    """Where pretrained weights can be loaded from, or None for a random initialisation."""
    if random_init:
        return None
    if spec.path and any((Path(spec.path) / name).is_file() for name in WEIGHT_FILES):
        return spec.path
    if spec.source == "hub" and _hub_usable():
        return spec.reference  # from_pretrained downloads them
    return None


def load_tokenizer(spec: ModelSpec, explicit: str | None = None,
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of `explicit`, else of the model reference; ModelNotFound saying what to pass."""
    from transformers import AutoTokenizer

    local_only = not _hub_usable()  # offline, ask only the local cache rather than wait for timeouts
    candidates = [explicit] if explicit else list(dict.fromkeys(c for c in (spec.path, spec.reference) if c))
    reasons = []
    for candidate in candidates:
        local = Path(candidate).expanduser()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else candidate,
                                                      local_files_only=local_only, trust_remote_code=trust_remote_code)
        except Exception as exc:  # OSError, ValueError, TypeError...: all mean "no usable tokenizer there"
            reasons.append(f"{candidate}: {' '.join(str(exc).split())[:160]}")
            continue
        if _tokenizes(tokenizer):
            return tokenizer
        # transformers 5 builds an empty tokenizer (no vocabulary) from a directory holding only
        # config.json rather than failing; packing text with it would make blocks of unknown tokens.
        reasons.append(f"{candidate}: no tokenizer files (an empty vocabulary)")
    if explicit:
        raise ModelNotFound(f"--tokenizer {explicit}: cannot load a tokenizer from it ({'; '.join(reasons)}); "
                            f"give a directory holding tokenizer files, or a hub id.")
    where = f"{spec.path} has no tokenizer files" if spec.path else f"{spec.reference} is not in the Hugging Face cache"
    raise ModelNotFound(f"no tokenizer for {spec.reference}: {where}"
                        f"{' and the hub is unreachable' if local_only else ''}; pass --tokenizer PATH "
                        f"(a directory saved with tokenizer.save_pretrained, or a hub id).")


def _tokenizes(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer has a vocabulary: plain English becomes known tokens."""
    try:
        ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot even encode English is as good as none
        return False
    unknown = getattr(tokenizer, "unk_token_id", None)
    return len(tokenizer) > 1 and bool(ids) and any(i != unknown for i in ids)


def check_vocabulary(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> None:
    """BadInput when the tokenizer makes ids that the model has no embedding for."""
    vocab = spec.config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise BadInput(f"the tokenizer has {len(tokenizer):,} tokens but {spec.reference}'s vocabulary has {vocab:,}: "
                       f"ids past {vocab - 1} have no embedding; pass the model's own tokenizer with --tokenizer.")


def build_model(spec: ModelSpec, config: ProbeConfig, device: torch.device, weights: str | None,
                trust_remote_code: bool = False, labels: Labels | None = None,
                pad_token_id: int | None = None) -> PreTrainedModel:
    """The model of `config.task` (the class the probe built) to train, as the probe built it: in
    fp32 (mixed precision keeps fp32 master weights), or in bf16 for pure bf16 (`weights` bf16);
    with LoRA adapters on its frozen base when `config.peft` (a peft.PeftModel, which answers as
    the model it wraps), the base's linear layers in 4 bits for QLoRA. A classifier gets the data's `labels`
    and, where its config has none, the tokenizer's `pad_token_id` (decoder classifiers find each
    sequence's last token by it)."""
    import torch
    from transformers import AutoConfig, BitsAndBytesConfig

    from autotune.probe.step import auto_class, from_config, task_config, weights_dtype, with_adapters
    from autotune.recipes import bnb_4bit_kwargs, is_qlora
    from autotune.tasks import Task

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
            extra.update(quantization_config=BitsAndBytesConfig(**bnb_4bit_kwargs(config.precision, config.task)),
                         device_map={"": device})
        model = auto_class(config.task).from_pretrained(weights, config=hf_config, attn_implementation=config.attention,
                                                        dtype=dtype, trust_remote_code=trust_remote_code, **extra)
    elif is_qlora(config.peft):
        from autotune.probe.qlora import build_4bit

        model = build_4bit(lambda: from_config(hf_config, config, trust_remote_code, dtype=dtype), config, device, dtype)
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

