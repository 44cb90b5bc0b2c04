"""The winner in the config of the fine-tuning tool people already use: TRL's SFTConfig, axolotl's
YAML, LLaMA-Factory's YAML, Lightning's LightningCLI YAML (`autotune best --format trl|axolotl|
llamafactory|lightning`).

One table per tool (autotune's lever -> the tool's key), read from the tool's current source, named
beside it; each writer takes its keys from its table, and tests/test_handoff_tools.py checks every
key it emits against the tool's own field list. Where a tool has no key for a lever autotune decided,
the document says what to do by hand (`notes()`: YAML comments, or a JSON "notes" list), never
silently nothing. Torch-free: `autotune best` imports it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from autotune.levers import sharding
from autotune.vocabulary import yaml_text
from autotune.vocabulary.errors import BadInput
import autotune.handoff.ranks as ranks
from autotune.handoff.lightning import LIGHTNING, lightning_document, lightning_notes
from autotune.levers.lengths import DEFAULT_SAMPLING, Lengths
from autotune.levers.recipes import OPTIMIZERS, PeftSpec, is_qlora
from autotune.levers.tasks import Task

if TYPE_CHECKING:
    from autotune.handoff.best_config import BestConfig

__all__ = [
    "AXOLOTL",
    "LIGHTNING",
    "LLAMAFACTORY",
    "TOOL_FORMATS",
    "TRL",
    "axolotl_document",
    "lightning_document",
    "llamafactory_document",
    "notes",
    "render_tool",
    "tool_document",
    "trl_document",
]

TOOL_FORMATS = ("trl", "axolotl", "llamafactory", "lightning")

# TRL: SFTConfig (a TrainingArguments subclass) and SFTTrainer, trl 1.16.0 as installed from PyPI:
# trl/trainer/sft_config.py and trl/trainer/base_config.py (github huggingface/trl; mirror read at
# f2cd57710ae345ea6428ae95363267fcf38a3dc8). TrainingArguments' own levers keep BestConfig.trainer_kwargs()'s
# names (checkpointing: as the installed transformers names it); these are what SFTConfig adds.
TRL = {
    "micro_batch": "per_device_train_batch_size",
    "eval_batch": "per_device_eval_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "bf16": "bf16",  # SFTConfig's defaults on unless fp16: always said, as all three are
    "fp16": "fp16",
    "tf32": "tf32",
    "checkpointing": "gradient_checkpointing",  # SFTConfig defaults it ON: always said (transformers >= 5.23:
    # activation_checkpointing, as BestConfig.trainer_kwargs() names it)
    "optimizer": "optim",
    "optimizer_args": "optim_args",
    "block_size": "max_length",  # (`max_seq_length` before trl 0.20)
    "full_blocks": "packing",  # full blocks of max_length tokens, as the probes measured...
    "packing_strategy": "packing_strategy",  # ..."wrapped": cut mid-sequence like run_clm.py, no padding-free
    "padding_free": "padding_free",  # each micro-batch's examples end to end (TRL cuts none then)
    "model_loading": "model_init_kwargs",  # attn_implementation, dtype, use_cache, QLoRA's quantization_config
    "eval_loss_only": "prediction_loss_only",
    "eval_accumulation": "eval_accumulation_steps",
    "compile": "torch_compile",
    "liger": "use_liger_kernel",
    "strategy": "fsdp_config",
    "ddp": "ddp_find_unused_parameters",
    "cpu": "use_cpu",
    "lora": "peft_config",  # SFTTrainer's argument, not SFTConfig's: the render's "peft_config"
}

# axolotl: AxolotlInputConfig, github axolotl-ai-cloud/axolotl at 067b021c8b87a9e5e380b9173c704cf7340e30f5
# (v0.18.0-9): src/axolotl/utils/schemas/{config,training,peft,fsdp}.py; the Liger plugin's keys:
# src/axolotl/integrations/liger/args.py.
AXOLOTL = {
    "model": "base_model",
    "micro_batch": "micro_batch_size",
    "eval_batch": "eval_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "block_size": "sequence_len",
    "full_blocks": "pad_to_sequence_len",
    "packing": "sample_packing",  # off by default; the probes of a per-example study time it off
    "sampling": "group_by_length",  # (axolotl's own key: it sets the installed transformers' sampler)
    "bf16": "bf16",  # defaults to "auto": always said
    "fp16": "fp16",
    "tf32": "tf32",  # defaults to "auto": always said
    "weights": "bfloat16",  # bf16 weights without autocast (non-AMP)
    "checkpointing": "gradient_checkpointing",
    "checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "attention": "attn_implementation",
    "optimizer": "optimizer",
    "optimizer_args": "optim_args",
    "peft": "adapter",  # lora | qlora
    "lora_rank": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_targets": "lora_target_modules",
    "lora_all_linear": "lora_target_linear",
    "qlora": "load_in_4bit",
    "compile": "torch_compile",
    "liger": "plugins",
    "strategy": "fsdp_config",
    "fsdp_version": "fsdp_version",
    "ddp": "ddp_find_unused_parameters",
}
AXOLOTL_LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"
# What transformers' use_liger_kernel patches (apply_liger_kernel_to_*'s defaults), as the plugin names it.
AXOLOTL_LIGER_KEYS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy")

# LLaMA-Factory: github hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30 (v0.9.5-54):
# src/llamafactory/hparams/{model_args,data_args,finetuning_args,training_args}.py (its TrainingArguments is
# transformers' Seq2SeqTrainingArguments); flash_attn's values: src/llamafactory/extras/constants.py.
LLAMAFACTORY = {
    "model": "model_name_or_path",
    "micro_batch": "per_device_train_batch_size",
    "eval_batch": "per_device_eval_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "block_size": "cutoff_len",
    "packing": "packing",  # data_args: off for sft unless set; a per-example study says off
    "sampling": "train_sampling_strategy",  # (transformers 5's TrainingArguments, which LLaMA-Factory's is)
    "bf16": "bf16",
    "fp16": "fp16",
    "tf32": "tf32",
    "weights": "pure_bf16",
    "checkpointing": "disable_gradient_checkpointing",  # ON by default: always said, inverted
    "checkpointing_kwargs": "use_reentrant_gc",  # True by default; the probes ran use_reentrant=False
    "attention": "flash_attn",
    "optimizer": "optim",
    "optimizer_args": "optim_args",
    "peft": "finetuning_type",  # lora | full
    "lora_rank": "lora_rank",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_targets": "lora_target",
    "qlora": "quantization_bit",
    "qlora_method": "quantization_method",
    "qlora_type": "quantization_type",
    "qlora_double": "double_quantization",
    "compile": "torch_compile",
    "liger": "enable_liger_kernel",
    "eval_loss_only": "prediction_loss_only",
    "eval_accumulation": "eval_accumulation_steps",
    "ddp": "ddp_find_unused_parameters",
    "cpu": "use_cpu",
}
# transformers' attn_implementation -> LLaMA-Factory's AttentionFunction (flex_attention has none).
LLAMAFACTORY_ATTENTION = {"sdpa": "sdpa", "eager": "disabled", "flash_attention_2": "fa2", "flash_attention_3": "fa3"}


def _causal_lm_only(best: BestConfig, tool: str) -> None:
    if best.task != Task.CAUSAL_LM:
        raise BadInput(
            f"--format {tool}: {tool} fine-tunes causal language models, and this study's task is "
            f"{best.task}; use --format trainer-args (or lightning) instead."
        )


def _no_padding_free(best: BestConfig, tool: str, key: str) -> None:
    if best.config.padding_free:
        raise BadInput(
            f"--format {tool}: the pick puts each micro-batch's examples end to end without padding "
            f"(padding-free), which {tool} does only with {key}, packing examples into other batches than "
            f"the probes timed; use --format trl or the Trainer's hand-off (DataCollatorWithFlattening), or "
            f"search with --padding-free off."
        )


def _lora(best: BestConfig) -> PeftSpec | None:
    return None if best.config.peft is None else PeftSpec.from_text(best.config.peft)


# --- TRL ---------------------------------------------------------------------------------------------


def trl_document(best: BestConfig) -> dict:
    """`trl.SFTConfig`'s keyword arguments (output_dir aside): TrainingArguments' as `trainer_kwargs()`
    has them (SFTConfig is one), the sequence length, full blocks as the probes measured, and the model's
    loading arguments (SFTTrainer loads a model given by name with `model_init_kwargs`)."""
    _causal_lm_only(best, "trl")
    kwargs = best.trainer_kwargs()  # the checkpointing flag always among them: SFTConfig turns it on unless told
    kwargs[TRL["block_size"]] = best.block_size
    if best.config.lengths is None:
        kwargs.update({TRL["full_blocks"]: True, TRL["packing_strategy"]: "wrapped"})
    else:  # each example a row, padded to its batch's longest, as the probes drew them (autotune.levers.lengths)
        kwargs[TRL["full_blocks"]] = False
    if best.config.padding_free:
        if Lengths.from_text(best.config.lengths or "").longest > best.block_size:
            raise BadInput(
                f"--format trl: the pick is padding-free, under which TRL cuts no example (SFTTrainer "
                f"refuses max_length then), and the study's data has examples above its {best.block_size} "
                f"tokens: cut them to {best.block_size} first, or search with --padding-free off."
            )
        kwargs.update({TRL["padding_free"]: True, TRL["block_size"]: None})
    kwargs[TRL["model_loading"]] = best.model_kwargs()
    return kwargs


def _trl_notes(best: BestConfig) -> list[str]:
    said = []
    if (spec := _lora(best)) is not None:
        said.append(f"{spec.text()}: pass SFTTrainer(peft_config=peft.LoraConfig(**document['peft_config']))")
    if best.config.padding_free:
        said.append(
            f"max_length: null, as SFTTrainer requires with padding_free: the study's examples were at most "
            f"{best.block_size} tokens; cut longer ones to it"
        )
    said.append(
        "model_init_kwargs apply when SFTTrainer is given the model's name; an already built model: "
        "load it with autotune.best(...).load_model(name)"
    )
    return said


# --- axolotl -----------------------------------------------------------------------------------------


def axolotl_document(best: BestConfig) -> dict:
    """axolotl's YAML keys for the winner (the dataset, learning rate and the like stay the user's)."""
    _causal_lm_only(best, "axolotl")
    _no_padding_free(best, "axolotl", "sample_packing")
    c, a = best.config, AXOLOTL
    pure_bf16 = c.weights == "bf16"
    doc: dict = {a["model"]: c.model, a["micro_batch"]: c.micro_batch}
    if best.eval_batch is not None:
        doc[a["eval_batch"]] = best.eval_batch
    doc.update({a["grad_accum"]: c.grad_accum, a["block_size"]: c.block_size})
    if c.lengths is None:
        doc[a["full_blocks"]] = True
    else:  # each example a row, padded to its batch's longest, as the probes drew them (autotune.levers.lengths)
        doc.update({a["packing"]: False, a["full_blocks"]: False})
        if c.sampling != DEFAULT_SAMPLING:
            doc[a["sampling"]] = True
    doc.update({a["bf16"]: c.precision == "bf16", a["fp16"]: c.precision == "fp16", a["tf32"]: c.precision == "tf32"})
    if pure_bf16 and c.precision != "bf16":
        doc[a["weights"]] = True
    doc[a["checkpointing"]] = c.checkpointing
    if c.checkpointing:
        doc[a["checkpointing_kwargs"]] = {"use_reentrant": False}
    doc[a["attention"]] = c.attention
    doc[a["optimizer"]] = OPTIMIZERS[c.optimizer].optim
    if OPTIMIZERS[c.optimizer].optim_args:
        doc[a["optimizer_args"]] = OPTIMIZERS[c.optimizer].optim_args
    if (spec := _lora(best)) is not None:
        doc.update(
            {
                a["peft"]: spec.kind,
                a["lora_rank"]: spec.rank,
                a["lora_alpha"]: spec.alpha,
                a["lora_dropout"]: spec.dropout,
            }
        )
        if spec.targets == "all-linear":
            doc[a["lora_all_linear"]] = True
        else:
            doc[a["lora_targets"]] = spec.target_modules
        if is_qlora(c.peft):
            doc[a["qlora"]] = True
    if c.compile:
        doc[a["compile"]] = True
    if c.liger:
        doc[a["liger"]] = [AXOLOTL_LIGER_PLUGIN]
        doc.update({key: True for key in AXOLOTL_LIGER_KEYS})
    if c.ranks > 1:
        if sharding.is_fsdp(c.strategy):
            settings = ranks.trainer_kwargs(c)["fsdp_config"]
            fsdp = {
                "fsdp_version": settings["version"],
                "offload_params": settings["cpu_offload"],
                **{k: v for k, v in settings.items() if k not in ("version", "cpu_offload")},
            }
            if "transformer_layer_cls_to_wrap" in fsdp:
                fsdp["transformer_layer_cls_to_wrap"] = ",".join(fsdp["transformer_layer_cls_to_wrap"])
            doc[a["fsdp_version"]] = settings["version"]
            doc[a["strategy"]] = fsdp
        else:
            doc[a["ddp"]] = False
    return doc


def _axolotl_notes(best: BestConfig) -> list[str]:
    c = best.config
    said = []
    if c.weights == "fp32" and c.precision in ("bf16", "fp16"):
        said.append(
            f"axolotl loads the weights in {c.precision} when {c.precision}: true (its torch_dtype); the probes "
            f"kept fp32 master weights under autocast: the run needs less memory than measured, and trains "
            f"{c.precision} weights"
        )
    said += _eval_notes(
        best,
        "axolotl",
        loss_only_key=None,
        accumulation=f"axolotl sets eval_accumulation_steps to gradient_accumulation_steps ({c.grad_accum}) itself",
    )
    if c.ranks > 1:
        nodes = f" --num_machines {c.nodes}" if c.nodes > 1 else ""
        said.append(
            f"{c.ranks} processes, {c.strategy}: `axolotl train axolotl.yaml --launcher accelerate -- "
            f"--num_processes {c.ranks}{nodes}`; effective batch = {c.micro_batch} x {c.grad_accum} x "
            f"{c.ranks} = {c.effective_batch}"
        )
    if best.device_type == "cpu":
        said.append("the study measured a CPU run; axolotl trains on GPUs")
    return said


# --- LLaMA-Factory -----------------------------------------------------------------------------------


def llamafactory_document(best: BestConfig) -> dict:
    """LLaMA-Factory's YAML keys for the winner (`llamafactory-cli train this.yaml`, with the user's
    stage, dataset and template beside them)."""
    _causal_lm_only(best, "llamafactory")
    _no_padding_free(best, "llamafactory", "neat_packing")
    c, lf = best.config, LLAMAFACTORY
    doc: dict = {lf["model"]: c.model, lf["micro_batch"]: c.micro_batch}
    if best.eval_batch is not None:
        doc[lf["eval_batch"]] = best.eval_batch
    doc.update({lf["grad_accum"]: c.grad_accum, lf["block_size"]: c.block_size})
    if c.lengths is not None:  # each example a row, padded to its batch's longest (autotune.levers.lengths)
        doc[lf["packing"]] = False
        if c.sampling != DEFAULT_SAMPLING:
            doc[lf["sampling"]] = c.sampling
    doc.update(
        {lf["bf16"]: c.precision == "bf16", lf["fp16"]: c.precision == "fp16", lf["tf32"]: c.precision == "tf32"}
    )
    if c.weights == "bf16":
        doc[lf["weights"]] = True
    doc[lf["checkpointing"]] = not c.checkpointing
    if c.checkpointing:
        doc[lf["checkpointing_kwargs"]] = False
    if c.attention in LLAMAFACTORY_ATTENTION:
        doc[lf["attention"]] = LLAMAFACTORY_ATTENTION[c.attention]
    doc[lf["optimizer"]] = OPTIMIZERS[c.optimizer].optim
    if OPTIMIZERS[c.optimizer].optim_args:
        doc[lf["optimizer_args"]] = OPTIMIZERS[c.optimizer].optim_args
    spec = _lora(best)
    doc[lf["peft"]] = "full" if spec is None else "lora"
    if spec is not None:
        doc.update(
            {
                lf["lora_rank"]: spec.rank,
                lf["lora_alpha"]: spec.alpha,
                lf["lora_dropout"]: spec.dropout,
                lf["lora_targets"]: "all" if spec.targets == "all-linear" else spec.targets,
            }
        )
        if is_qlora(c.peft):  # NF4 with double quantization, computing in the precision's dtype, as the probes
            doc.update({lf["qlora"]: 4, lf["qlora_method"]: "bnb", lf["qlora_type"]: "nf4", lf["qlora_double"]: True})
    if c.compile:
        doc[lf["compile"]] = True
    if c.liger:
        doc[lf["liger"]] = True
    eval_kwargs = best.eval_kwargs()
    if eval_kwargs.get("prediction_loss_only"):
        doc[lf["eval_loss_only"]] = True
    if "eval_accumulation_steps" in eval_kwargs:
        doc[lf["eval_accumulation"]] = eval_kwargs["eval_accumulation_steps"]
    if c.ranks > 1 and not sharding.is_fsdp(c.strategy):
        doc[lf["ddp"]] = False
    if best.device_type == "cpu":
        doc[lf["cpu"]] = True
    return doc


def _llamafactory_notes(best: BestConfig) -> list[str]:
    c = best.config
    said = []
    if c.attention not in LLAMAFACTORY_ATTENTION:
        said.append(
            f"attention {c.attention}: LLaMA-Factory's flash_attn has no value for it (auto, disabled, sdpa, "
            f"fa2, fa3); load the model with attn_implementation={c.attention!r} yourself"
        )
    if c.peft is not None and c.weights == "fp32" and c.precision in ("bf16", "fp16") and not is_qlora(c.peft):
        said.append(
            f"LLaMA-Factory loads the frozen base in {c.precision} (its compute dtype); the probes held it in "
            f"fp32: the run needs less memory than measured"
        )
    said.append(
        f"batches are padded to their longest sequence, at most cutoff_len {c.block_size}; the probes measured "
        f"full {c.block_size}-token sequences, the most a batch can hold"
    )
    if c.ranks > 1:
        how = (
            "FSDP: `autotune best --format accelerate > accelerate_config.yaml`, then"
            if sharding.is_fsdp(c.strategy)
            else "DDP:"
        )
        said.append(
            f"{c.ranks} processes, {how} `accelerate launch --config_file {ranks.ACCELERATE_CONFIG_FILE} "
            f"-m llamafactory.cli train llamafactory.yaml` (or FORCE_TORCHRUN=1 NNODES={c.nodes} "
            f"NPROC_PER_NODE={c.gpus} llamafactory-cli train llamafactory.yaml for DDP); effective batch = "
            f"{c.micro_batch} x {c.grad_accum} x {c.ranks} = {c.effective_batch}"
        )
    return said


# --- shared ------------------------------------------------------------------------------------------


def _eval_notes(best: BestConfig, tool: str, loss_only_key: str | None, accumulation: str) -> list[str]:
    """What a tool without TrainingArguments' evaluation fields cannot say of the measured evaluation."""
    kwargs = best.eval_kwargs()
    said = []
    if kwargs.get("prediction_loss_only") and loss_only_key is None:
        said.append(
            f"loss-only evaluation: {tool} has no prediction_loss_only key; the probe kept no logits, so a "
            f"metric that keeps them needs more memory than measured"
        )
    if "eval_accumulation_steps" in kwargs and kwargs["eval_accumulation_steps"] != best.config.grad_accum:
        said.append(
            f"kept logits moved to the host every {kwargs['eval_accumulation_steps']} batch(es) as measured; "
            f"{accumulation}"
        )
    return said


_DOCUMENTS = {
    "trl": trl_document,
    "axolotl": axolotl_document,
    "llamafactory": llamafactory_document,
    "lightning": lightning_document,
}
_NOTES = {
    "trl": _trl_notes,
    "axolotl": _axolotl_notes,
    "llamafactory": _llamafactory_notes,
    "lightning": lightning_notes,
}


def tool_document(best: BestConfig, fmt: str) -> dict:
    """`fmt`'s keys for the winner, as `render_tool` writes them (its notes aside)."""
    return _DOCUMENTS[fmt](best)


def notes(best: BestConfig, fmt: str) -> list[str]:
    """What `fmt`'s document cannot say of the winner, one line each, to set by hand."""
    said = list(_NOTES[fmt](best))
    if environment := best.allocator_environment():
        settings = " ".join(f"{name}={value}" for name, value in environment.items())
        said.append(f"allocator {best.config.allocator}: start the run with {settings} in its environment")
    if (openmp := best.openmp_caveat("the run")) is not None:
        said.append(openmp)
    return said


def render_tool(best: BestConfig, fmt: str) -> str:
    """`autotune best --format trl|axolotl|llamafactory|lightning`: JSON for TRL ({"sft_config": SFTConfig's
    kwargs, "peft_config": LoraConfig's, "notes"}), YAML for the others, the notes as `#` comments."""
    if fmt not in _DOCUMENTS:
        raise ValueError(f"unknown tool format {fmt!r}")
    document = tool_document(best, fmt)
    said = notes(best, fmt)
    if fmt == "trl":
        out: dict = {"sft_config": document}
        if best.config.peft is not None:
            out["peft_config"] = best.lora_kwargs()
        out["notes"] = said
        return json.dumps(out, indent=2)
    header = [f"# autotune: the winner of study {best.row.study!r}: {best.config.label().strip()} ({fmt})"]
    return "\n".join(header + [f"# {line}" for line in said] + yaml_text.block_lines(document))
