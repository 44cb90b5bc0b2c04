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

from autotune import evaluation, sharding, yaml_text
from autotune.errors import BadInput
from autotune.handoff import ranks
from autotune.lengths import DEFAULT_SAMPLING
from autotune.recipes import OPTIMIZERS, PeftSpec, is_qlora
from autotune.tasks import Task

if TYPE_CHECKING:
    from autotune.handoff import BestConfig

__all__ = ["AXOLOTL", "LIGHTNING", "LLAMAFACTORY", "TOOL_FORMATS", "TRL", "axolotl_document", "lightning_document",
           "llamafactory_document", "notes", "render_tool", "tool_document", "trl_document"]

TOOL_FORMATS = ("trl", "axolotl", "llamafactory", "lightning")

# TRL: SFTConfig (a TrainingArguments subclass) and SFTTrainer, trl 1.16.0 as installed from PyPI:
# trl/trainer/sft_config.py and trl/trainer/base_config.py (github huggingface/trl; mirror read at
# f2cd57710ae345ea6428ae95363267fcf38a3dc8). TrainingArguments' own levers keep BestConfig.trainer_kwargs()'s
# names (checkpointing: as the installed transformers names it); these are what SFTConfig adds.
TRL = {
    "micro_batch": "per_device_train_batch_size",
    "eval_batch": "per_device_eval_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "bf16": "bf16",                          # SFTConfig's defaults on unless fp16: always said, as all three are
    "fp16": "fp16",
    "tf32": "tf32",
    "checkpointing": "gradient_checkpointing",  # SFTConfig defaults it ON: always said (transformers >= 5.23:
                                             # activation_checkpointing, as BestConfig.trainer_kwargs() names it)
    "optimizer": "optim",
    "optimizer_args": "optim_args",
    "block_size": "max_length",              # (`max_seq_length` before trl 0.20)
    "full_blocks": "packing",                # full blocks of max_length tokens, as the probes measured...
    "packing_strategy": "packing_strategy",  # ..."wrapped": cut mid-sequence like run_clm.py, no padding-free
    "model_loading": "model_init_kwargs",    # attn_implementation, dtype, use_cache, QLoRA's quantization_config
    "eval_loss_only": "prediction_loss_only",
    "eval_accumulation": "eval_accumulation_steps",
    "compile": "torch_compile",
    "liger": "use_liger_kernel",
    "strategy": "fsdp_config",
    "ddp": "ddp_find_unused_parameters",
    "cpu": "use_cpu",
    "lora": "peft_config",                   # SFTTrainer's argument, not SFTConfig's: the render's "peft_config"
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
    "packing": "sample_packing",   # off by default; the probes of a per-example study time it off
    "sampling": "group_by_length",  # (axolotl's own key: it sets the installed transformers' sampler)
    "bf16": "bf16",                # defaults to "auto": always said
    "fp16": "fp16",
    "tf32": "tf32",                # defaults to "auto": always said
    "weights": "bfloat16",         # bf16 weights without autocast (non-AMP)
    "checkpointing": "gradient_checkpointing",
    "checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "attention": "attn_implementation",
    "optimizer": "optimizer",
    "optimizer_args": "optim_args",
    "peft": "adapter",             # lora | qlora
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
    "packing": "packing",          # data_args: off for sft unless set; a per-example study says off
    "sampling": "train_sampling_strategy",  # (transformers 5's TrainingArguments, which LLaMA-Factory's is)
    "bf16": "bf16",
    "fp16": "fp16",
    "tf32": "tf32",
    "weights": "pure_bf16",
    "checkpointing": "disable_gradient_checkpointing",  # ON by default: always said, inverted
    "checkpointing_kwargs": "use_reentrant_gc",         # True by default; the probes ran use_reentrant=False
    "attention": "flash_attn",
    "optimizer": "optim",
    "optimizer_args": "optim_args",
    "peft": "finetuning_type",                          # lora | full
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

# Lightning 2.6.6 (PyPI `lightning`): lightning/pytorch/trainer/trainer.py (Trainer.__init__),
# lightning/pytorch/strategies/fsdp.py (FSDPStrategy), lightning/pytorch/cli.py (LightningCLI's sections
# trainer/model/data/optimizer). `data` and `model` are the user's classes' __init__ arguments: these
# names are a convention (the test's LightningModule and DataModule take them).
LIGHTNING = {
    "micro_batch": "data.batch_size",
    "eval_batch": "data.eval_batch_size",
    "block_size": "data.block_size",
    "grad_accum": "trainer.accumulate_grad_batches",
    "precision": "trainer.precision",
    "device": "trainer.accelerator",
    "gpus": "trainer.devices",
    "nodes": "trainer.num_nodes",
    "strategy": "trainer.strategy",
    "attention": "model.attn_implementation",
    "checkpointing": "model.gradient_checkpointing",
    "lora": "model.lora_config",
    "qlora": "model.quantization_config",
    "optimizer": "optimizer",   # LightningCLI's own section: class_path and init_args
}
# Lightning's precision plugins: (autotune precision, weights) -> Trainer(precision=...).
LIGHTNING_PRECISION = {("fp32", "fp32"): "32-true", ("tf32", "fp32"): "32-true", ("bf16", "fp32"): "bf16-mixed",
                       ("fp16", "fp32"): "16-mixed", ("bf16", "bf16"): "bf16-true", ("fp32", "bf16"): "bf16-true",
                       ("tf32", "bf16"): "bf16-true"}
# TrainingArguments' optim -> the optimizer class Trainer builds for it, and its arguments (Trainer's
# get_optimizer_cls_and_kwargs), as LightningCLI's `optimizer:` section names them.
LIGHTNING_OPTIMIZERS: dict[str, tuple[str, dict]] = {
    "adamw": ("torch.optim.AdamW", {"fused": True}),
    "adamw_torch": ("torch.optim.AdamW", {}),
    "adafactor": ("transformers.optimization.Adafactor", {"scale_parameter": False, "relative_step": False}),
    "sgd": ("torch.optim.SGD", {"momentum": 0.9}),
    "adamw_8bit": ("bitsandbytes.optim.AdamW8bit", {}),
    "paged_adamw_8bit": ("bitsandbytes.optim.PagedAdamW8bit", {}),
}
_FSDP_SHARDING = {"fsdp": "FULL_SHARD", "fsdp-offload": "FULL_SHARD", "fsdp-grad-op": "SHARD_GRAD_OP"}


def _causal_lm_only(best: BestConfig, tool: str) -> None:
    if best.task != Task.CAUSAL_LM:
        raise BadInput(f"--format {tool}: {tool} fine-tunes causal language models, and this study's task is "
                       f"{best.task}; use --format trainer-args (or lightning) instead.")


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
    else:  # each example a row, padded to its batch's longest, as the probes drew them (autotune.lengths)
        kwargs[TRL["full_blocks"]] = False
    kwargs[TRL["model_loading"]] = best.model_kwargs()
    return kwargs


def _trl_notes(best: BestConfig) -> list[str]:
    said = []
    if (spec := _lora(best)) is not None:
        said.append(f"{spec.text()}: pass SFTTrainer(peft_config=peft.LoraConfig(**document['peft_config']))")
    said.append("model_init_kwargs apply when SFTTrainer is given the model's name; an already built model: "
                "load it with autotune.best(...).load_model(name)")
    return said


# --- axolotl -----------------------------------------------------------------------------------------

def axolotl_document(best: BestConfig) -> dict:
    """axolotl's YAML keys for the winner (the dataset, learning rate and the like stay the user's)."""
    _causal_lm_only(best, "axolotl")
    c, a = best.config, AXOLOTL
    pure_bf16 = c.weights == "bf16"
    doc: dict = {a["model"]: c.model, a["micro_batch"]: c.micro_batch}
    if best.eval_batch is not None:
        doc[a["eval_batch"]] = best.eval_batch
    doc.update({a["grad_accum"]: c.grad_accum, a["block_size"]: c.block_size})
    if c.lengths is None:
        doc[a["full_blocks"]] = True
    else:  # each example a row, padded to its batch's longest, as the probes drew them (autotune.lengths)
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
        doc.update({a["peft"]: spec.kind, a["lora_rank"]: spec.rank, a["lora_alpha"]: spec.alpha,
                    a["lora_dropout"]: spec.dropout})
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
            fsdp = {"fsdp_version": settings["version"], "offload_params": settings["cpu_offload"],
                    **{k: v for k, v in settings.items() if k not in ("version", "cpu_offload")}}
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
        said.append(f"axolotl loads the weights in {c.precision} when {c.precision}: true (its torch_dtype); the probes "
                    f"kept fp32 master weights under autocast: the run needs less memory than measured, and trains "
                    f"{c.precision} weights")
    said += _eval_notes(best, "axolotl", loss_only_key=None,
                        accumulation="axolotl sets eval_accumulation_steps to gradient_accumulation_steps "
                                     f"({c.grad_accum}) itself")
    if c.ranks > 1:
        nodes = f" --num_machines {c.nodes}" if c.nodes > 1 else ""
        said.append(f"{c.ranks} processes, {c.strategy}: `axolotl train axolotl.yaml --launcher accelerate -- "
                    f"--num_processes {c.ranks}{nodes}`; effective batch = {c.micro_batch} x {c.grad_accum} x "
                    f"{c.ranks} = {c.effective_batch}")
    if best.device_type == "cpu":
        said.append("the study measured a CPU run; axolotl trains on GPUs")
    return said


# --- LLaMA-Factory -----------------------------------------------------------------------------------

def llamafactory_document(best: BestConfig) -> dict:
    """LLaMA-Factory's YAML keys for the winner (`llamafactory-cli train this.yaml`, with the user's
    stage, dataset and template beside them)."""
    _causal_lm_only(best, "llamafactory")
    c, lf = best.config, LLAMAFACTORY
    doc: dict = {lf["model"]: c.model, lf["micro_batch"]: c.micro_batch}
    if best.eval_batch is not None:
        doc[lf["eval_batch"]] = best.eval_batch
    doc.update({lf["grad_accum"]: c.grad_accum, lf["block_size"]: c.block_size})
    if c.lengths is not None:  # each example a row, padded to its batch's longest (autotune.lengths)
        doc[lf["packing"]] = False
        if c.sampling != DEFAULT_SAMPLING:
            doc[lf["sampling"]] = c.sampling
    doc.update({lf["bf16"]: c.precision == "bf16",
                lf["fp16"]: c.precision == "fp16", lf["tf32"]: c.precision == "tf32"})
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
        doc.update({lf["lora_rank"]: spec.rank, lf["lora_alpha"]: spec.alpha, lf["lora_dropout"]: spec.dropout,
                    lf["lora_targets"]: "all" if spec.targets == "all-linear" else spec.targets})
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
        said.append(f"attention {c.attention}: LLaMA-Factory's flash_attn has no value for it (auto, disabled, sdpa, "
                    f"fa2, fa3); load the model with attn_implementation={c.attention!r} yourself")
    if c.peft is not None and c.weights == "fp32" and c.precision in ("bf16", "fp16") and not is_qlora(c.peft):
        said.append(f"LLaMA-Factory loads the frozen base in {c.precision} (its compute dtype); the probes held it in "
                    f"fp32: the run needs less memory than measured")
    said.append(f"batches are padded to their longest sequence, at most cutoff_len {c.block_size}; the probes measured "
                f"full {c.block_size}-token sequences, the most a batch can hold")
    if c.ranks > 1:
        how = ("FSDP: `autotune best --format accelerate > accelerate_config.yaml`, then" if sharding.is_fsdp(c.strategy)
               else "DDP:")
        said.append(f"{c.ranks} processes, {how} `accelerate launch --config_file {ranks.ACCELERATE_CONFIG_FILE} "
                    f"-m llamafactory.cli train llamafactory.yaml` (or FORCE_TORCHRUN=1 NNODES={c.nodes} "
                    f"NPROC_PER_NODE={c.gpus} llamafactory-cli train llamafactory.yaml for DDP); effective batch = "
                    f"{c.micro_batch} x {c.grad_accum} x {c.ranks} = {c.effective_batch}")
    return said


# --- Lightning ---------------------------------------------------------------------------------------

def lightning_document(best: BestConfig) -> dict:
    """A LightningCLI config: `trainer` (Trainer's arguments), `data` and `model` (the user's
    DataModule's and LightningModule's arguments, by the names LIGHTNING gives), `optimizer`."""
    c, lt = best.config, LIGHTNING
    doc: dict = {"trainer": {}, "data": {}, "model": {}}
    _put(doc, lt["device"], "cpu" if best.device_type == "cpu" else "gpu")
    _put(doc, lt["gpus"], c.gpus)
    _put(doc, lt["nodes"], c.nodes)
    _put(doc, lt["precision"], LIGHTNING_PRECISION[(c.precision, c.weights)])
    _put(doc, lt["grad_accum"], c.grad_accum)
    if c.ranks > 1:
        _put(doc, lt["strategy"], "ddp" if not sharding.is_fsdp(c.strategy) else {
            "class_path": "lightning.pytorch.strategies.FSDPStrategy",
            "init_args": {"sharding_strategy": _FSDP_SHARDING[c.strategy], "cpu_offload": sharding.offloads(c.strategy),
                          "state_dict_type": "full"}})
    _put(doc, lt["micro_batch"], c.micro_batch)
    if best.eval_batch is not None:
        _put(doc, lt["eval_batch"], best.eval_batch)
    _put(doc, lt["block_size"], c.block_size)
    _put(doc, lt["attention"], c.attention)
    _put(doc, lt["checkpointing"], c.checkpointing)
    if c.peft is not None:
        _put(doc, lt["lora"], best.lora_kwargs())
    if is_qlora(c.peft):
        _put(doc, lt["qlora"], best.load_kwargs()["quantization_config"])
    class_path, init_args = LIGHTNING_OPTIMIZERS[c.optimizer]
    _put(doc, lt["optimizer"], {"class_path": class_path, **({"init_args": dict(init_args)} if init_args else {})})
    return doc


def _put(document: dict, dotted: str, value) -> None:
    """Set `section.key` (a table's dotted name) in a nested document."""
    *sections, key = dotted.split(".")
    for section in sections:
        document = document.setdefault(section, {})
    document[key] = value


def _lightning_notes(best: BestConfig) -> list[str]:
    c = best.config
    said = ["data and model are your LightningDataModule's and LightningModule's __init__ arguments: these names are "
            "a convention; the model loads with attn_implementation and calls "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False}) when "
            "gradient_checkpointing is true, as the probes did"]
    if c.precision == "tf32":
        said.append("tf32: Lightning has no flag for it; call torch.set_float32_matmul_precision(\"high\") before fit")
    if c.optimizer == "adafactor":
        said.append("adafactor: give optimizer.init_args.lr (relative_step is off, as Trainer's adafactor has it)")
    if c.compile:
        said.append("torch.compile: compile the model yourself (model = torch.compile(model)) before fit, as the probes did")
    if c.liger:
        said.append("Liger: apply liger_kernel's apply_liger_kernel_to_<model>() before building the model")
    if c.peft is not None:
        said.append("LoRA: wrap the loaded model with peft.get_peft_model(model, peft.LoraConfig(**lora_config)) "
                    "after turning checkpointing on")
    if is_qlora(c.peft):
        said.append("QLoRA: load the base with transformers.BitsAndBytesConfig(**model.quantization_config), keep "
                    "precision off '-true' (bitsandbytes layers hold their own dtype)")
    if evaluation.evaluates(c):
        eval_kwargs = best.eval_kwargs()
        if eval_kwargs.get("prediction_loss_only"):
            said.append("evaluation: return only the loss from validation_step, as the probe kept no logits")
        else:
            said.append(f"evaluation: the probe kept logits on the card for {c.eval_accumulation_steps} batch(es) "
                        f"before moving them to the host: do the same in validation_step")
        if evaluation.generates(c):
            said.append(f"generation at eval: call model.generate(max_length={c.generation_max_length}, "
                        f"num_beams={c.generation_num_beams}, use_cache=True) in validation_step")
    if c.ranks > 1 and sharding.is_fsdp(c.strategy):
        layers = ranks.layer_classes(c)
        wrap = f"{{{', '.join(layers)}}}" if layers else "the model's _no_split_modules"
        said.append(f"{c.strategy}: Lightning's FSDPStrategy is FSDP1 and the probes measured FSDP2 (fully_shard) "
                    f"wrapping each of {wrap}: give FSDPStrategy(auto_wrap_policy={wrap}) in code (YAML cannot name a "
                    f"set of classes), or use ModelParallelStrategy with fully_shard in configure_model")
    return said


# --- shared ------------------------------------------------------------------------------------------

def _eval_notes(best: BestConfig, tool: str, loss_only_key: str | None, accumulation: str) -> list[str]:
    """What a tool without TrainingArguments' evaluation fields cannot say of the measured evaluation."""
    kwargs = best.eval_kwargs()
    said = []
    if kwargs.get("prediction_loss_only") and loss_only_key is None:
        said.append(f"loss-only evaluation: {tool} has no prediction_loss_only key; the probe kept no logits, so a "
                    f"metric that keeps them needs more memory than measured")
    if "eval_accumulation_steps" in kwargs and kwargs["eval_accumulation_steps"] != best.config.grad_accum:
        said.append(f"kept logits moved to the host every {kwargs['eval_accumulation_steps']} batch(es) as measured; "
                    f"{accumulation}")
    return said


_DOCUMENTS = {"trl": trl_document, "axolotl": axolotl_document, "llamafactory": llamafactory_document,
              "lightning": lightning_document}
_NOTES = {"trl": _trl_notes, "axolotl": _axolotl_notes, "llamafactory": _llamafactory_notes,
          "lightning": _lightning_notes}


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
