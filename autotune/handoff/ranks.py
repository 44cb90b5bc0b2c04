"""A winner on several GPUs handed to the real run: the accelerate config file that `accelerate launch
--config_file` reads, the launch command lines, and TrainingArguments' `fsdp`/`fsdp_config` for Trainer.

Each form says what the probe ran (autotune/probe/distributed.py), in the names accelerate 1.15 and
transformers 5.24 read:

- `ddp`: accelerate's MULTI_GPU, DistributedDataParallel with its defaults. Trainer would turn
  `find_unused_parameters` on for a model without checkpointing (an extra walk of the graph each
  step): `ddp_find_unused_parameters=False` keeps the probe's default.
- `fsdp*`: accelerate's FSDP2 (`fsdp_version: 2`), transformer-based wrap of the model's
  `_no_split_modules` (accelerate's fallback when no class is named, and the probe's list),
  `reshard_after_forward` and CPU offload as the strategy says (autotune.levers.sharding); the mixed
  precision policy follows `mixed_precision`, as the probe's does.
- Checkpointing: the probe calls transformers' `activation_checkpointing_enable(use_reentrant=False)`
  on the model before sharding, as Trainer's `activation_checkpointing=True` does before
  `accelerator.prepare`. accelerate's `fsdp_activation_checkpointing` would wrap the layers in
  torch's `checkpoint_wrapper` instead (for BERT-like models its embeddings too), and both together
  would recompute twice; so the hand-off turns transformers' on and leaves accelerate's off.
  transformers warns that its own checkpointing costs FSDP a redundant all-gather in backward: that
  is FSDP1's behaviour; FSDP2's forward hook skips the all-gather while recomputing in backward
  (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_pre_forward`), so the probe's measurement
  stands.

Torch-free (`autotune best` reads it): the layer class comes from a table by model type, checked
against the installed transformers by tests/test_handoff_ranks.py; for a model type not in it the
key is left out and accelerate wraps the model's `_no_split_modules` itself, the very layers the
probe wrapped.
"""

from __future__ import annotations

import json
from pathlib import Path

from autotune.levers import sharding
from autotune.levers.config import ProbeConfig

__all__ = [
    "ACCELERATE_CONFIG_FILE",
    "LAYER_CLASSES",
    "accelerate_config",
    "accelerate_yaml",
    "launch_command",
    "layer_classes",
    "summary_lines",
    "trainer_kwargs",
]

ACCELERATE_CONFIG_FILE = "accelerate_config.yaml"
# transformers' `_no_split_modules` of each family's task classes (they share one PreTrainedModel).
LAYER_CLASSES: dict[str, tuple[str, ...]] = {
    "gpt2": ("GPT2Block",),
    "gpt_neox": ("GPTNeoXLayer",),
    "opt": ("OPTDecoderLayer",),
    "llama": ("LlamaDecoderLayer",),
    "mistral": ("MistralDecoderLayer",),
    "mixtral": ("MixtralDecoderLayer",),
    "qwen2": ("Qwen2DecoderLayer",),
    "qwen3": ("Qwen3DecoderLayer",),
    "gemma": ("GemmaDecoderLayer",),
    "gemma2": ("Gemma2DecoderLayer",),
    "phi": ("PhiDecoderLayer",),
    "phi3": ("Phi3DecoderLayer",),
    "falcon": ("FalconDecoderLayer",),
    "olmo2": ("Olmo2DecoderLayer",),
    "smollm3": ("SmolLM3DecoderLayer",),
    "t5": ("T5Block",),
}  # (not BERT's nor RoBERTa's: their task classes have none, only their base models, so nothing is wrapped)
_MIXED_PRECISION = {"fp16": "fp16", "bf16": "bf16"}  # fp32 and tf32 train without autocast: "no"
# Saved as one Hugging Face checkpoint (Trainer's default), gathered to the host on save: the probe
# measures no save, and a sharded one could not be loaded by from_pretrained.
_STATE_DICT_TYPE = "FULL_STATE_DICT"


def _model_type(reference: str) -> str | None:
    """The model's `model_type`, read offline (a local directory or config.json, the Hugging Face
    cache, the built-in GPT-2 family); None where only the hub could say."""
    from autotune.specs.models import KNOWN_ARCHITECTURES

    path = Path(reference).expanduser()
    config_file = path / "config.json" if path.is_dir() else path if path.suffix == ".json" else None
    if config_file is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(reference, "config.json")
        except Exception:  # not a valid repo id, or no huggingface_hub: not in the cache either way
            cached = None
        config_file = Path(cached) if isinstance(cached, str) else None
    if config_file is not None:
        try:
            value = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None
    builtin = KNOWN_ARCHITECTURES.get(reference.rsplit("/", 1)[-1])
    return None if builtin is None else str(builtin["model_type"])


def layer_classes(config: ProbeConfig) -> tuple[str, ...] | None:
    """The transformer layer classes FSDP wraps one unit each (the model's `_no_split_modules`), or
    None where they are not known here: accelerate and Trainer then read the model's own list."""
    model_type = _model_type(config.model)
    return None if model_type is None else LAYER_CLASSES.get(model_type)


def accelerate_config(config: ProbeConfig, device_type: str = "cuda") -> dict:
    """The winner as accelerate's config file (ClusterConfig's fields), for `accelerate launch --config_file`."""
    if config.ranks == 1:
        distributed = "NO"
    else:
        distributed = "FSDP" if sharding.is_fsdp(config.strategy) else "MULTI_GPU"
    document: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED_PRECISION.get(config.precision, "no"),
        "num_machines": config.nodes,
        "num_processes": config.ranks,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": device_type == "cpu",
    }
    if sharding.is_fsdp(config.strategy):
        fsdp: dict = {}
        for key, value in _fsdp_settings(config).items():  # (Trainer's names, as accelerate's file names them)
            if key == "transformer_layer_cls_to_wrap":
                value = ",".join(value)
            fsdp[_ACCELERATE_NAMES.get(key, f"fsdp_{key}")] = value
            if key == "cpu_ram_efficient_loading":
                # `accelerate launch` refuses it without fsdp_sync_module_states, which FSDP2 itself ignores.
                fsdp["fsdp_sync_module_states"] = True
        document["fsdp_config"] = fsdp
    if config.compile:
        document["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    return dict(sorted(document.items()))


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # quoted: YAML 1.1 would read a bare `no` as false


def accelerate_yaml(config: ProbeConfig, device_type: str = "cuda", study: str | None = None) -> str:
    """`accelerate_config()` as the YAML file `accelerate launch --config_file` reads, with comments."""
    lines = [
        f"# autotune: the winner of study {study!r}: {config.label().strip()}"
        if study
        else f"# autotune: {config.label().strip()}",
        f"# Launch: {launch_command(config, 'train.py', device_type=device_type)}",
        f"# Effective batch: micro_batch {config.micro_batch} x grad_accum {config.grad_accum} x {config.ranks} "
        f"processes = {config.effective_batch} sequences per optimizer step.",
        f"# Per process: batch size {config.micro_batch}, gradient accumulation {config.grad_accum}: the script's "
        "(TrainingArguments' or Accelerator's), not this file's.",
    ]
    if config.checkpointing:
        lines.append(
            "# Checkpointing: the script turns on transformers' (Trainer: activation_checkpointing=True, "
            'activation_checkpointing_kwargs={"use_reentrant": false}; by hand: model.activation_checkpointing_enable('
            'activation_checkpointing_kwargs={"use_reentrant": False}), gradient_checkpointing_enable before '
            "transformers 5.23), as the probe measured; not fsdp_activation_checkpointing."
        )
    if sharding.is_fsdp(config.strategy) and layer_classes(config) is None:
        lines.append(
            "# No fsdp_transformer_layer_cls_to_wrap: accelerate wraps the model's _no_split_modules, as the probe did."
        )
    for key, value in accelerate_config(config, device_type).items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {name}: {_scalar(item)}" for name, item in value.items()]
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines)


def launch_command(
    config: ProbeConfig,
    script: str = "train.py",
    *,
    launcher: str = "accelerate",
    config_file: str = ACCELERATE_CONFIG_FILE,
    device_type: str = "cuda",
) -> str:
    """The command line that starts the run's processes: `accelerate launch` with the config file (any
    script: Accelerator's or Trainer's), or `torchrun` (a Trainer script given `trainer_kwargs()`,
    which carry the FSDP settings themselves). On CPU, accelerate's ranks are told so by
    ACCELERATE_USE_CPU: its multi-process launcher does not pass the file's use_cpu on to them."""
    if launcher == "torchrun":
        if config.nodes > 1:  # (run on every node, each with its --node-rank; the first node's address)
            return (
                f"torchrun --nnodes {config.nodes} --node-rank NODE_RANK --nproc-per-node {config.gpus} "
                f"--master-addr FIRST_NODE --master-port 29500 {script}"
            )
        return f"torchrun --nproc-per-node {config.gpus} {script}" if config.gpus > 1 else f"python {script}"
    if launcher != "accelerate":
        raise ValueError(f"unknown launcher {launcher!r}")
    cpu = "ACCELERATE_USE_CPU=true " if device_type == "cpu" and config.ranks > 1 else ""
    return f"{cpu}accelerate launch --config_file {config_file} {script}"


def trainer_kwargs(config: ProbeConfig) -> dict:
    """TrainingArguments' fields for a run on several GPUs (none for one): `fsdp` and `fsdp_config`
    (the keys transformers 5.24 reads, FSDP2) for an FSDP winner, `ddp_find_unused_parameters` for DDP."""
    if config.ranks == 1:
        return {}
    if not sharding.is_fsdp(config.strategy):
        return {"ddp_find_unused_parameters": False}
    return {"fsdp": True, "fsdp_config": _fsdp_settings(config)}


# accelerate's file names each setting "fsdp_" + Trainer's name, but for these.
_ACCELERATE_NAMES = {"cpu_offload": "fsdp_offload_params"}


def _fsdp_settings(config: ProbeConfig) -> dict:
    """The FSDP2 settings of an FSDP winner, as TrainingArguments' `fsdp_config` names them (the one
    home of what the probe measured: accelerate's file is made from these)."""
    strategy = config.strategy or ""
    settings: dict = {
        "version": 2,
        "reshard_after_forward": sharding.reshards_after_forward(strategy),
        "cpu_offload": sharding.offloads(strategy),
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    }
    if (layers := layer_classes(config)) is not None:
        settings["transformer_layer_cls_to_wrap"] = list(layers)
    # transformers' checkpointing instead of FSDP's (see the module's docstring). Rank 0 loads the
    # checkpoint, the others start on the meta device and receive their shards: no rank holds the
    # whole model, as in the probe (built on meta, then sharded).
    settings.update(activation_checkpointing=False, cpu_ram_efficient_loading=True, state_dict_type=_STATE_DICT_TYPE)
    return settings


def summary_lines(config: ProbeConfig, study: str, device_type: str = "cuda") -> list[str]:
    """What `print(autotune.best(...))` says of the ranks: how many, how they share, how to launch."""
    if config.ranks == 1:
        return []
    nodes = f" on {config.nodes} nodes of {config.gpus}" if config.nodes > 1 else ""
    return [
        f"  ranks:     {config.ranks} processes{nodes}, one GPU each, {config.strategy}; effective batch = micro_batch "
        f"{config.micro_batch} x grad_accum {config.grad_accum} x {config.ranks} = {config.effective_batch}",
        f"  launch:    {launch_command(config, 'train.py', device_type=device_type)}   "
        f"# `autotune best --study {study} --format accelerate > {ACCELERATE_CONFIG_FILE}`",
        f"             or, for a Trainer script given best.training_arguments(...): "
        f"{launch_command(config, 'train.py', launcher='torchrun')}",
    ]
