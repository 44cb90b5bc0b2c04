"""The winner as a LightningCLI config (`autotune best --format lightning`): Trainer's arguments,
the user's DataModule's and LightningModule's by a convention of names, and the optimizer section;
what Lightning has no key for, said as notes. Torch-free: `autotune best` imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.levers import evaluation
from autotune.levers import sharding
import autotune.handoff.ranks as ranks
from autotune.levers.recipes import is_qlora

if TYPE_CHECKING:
    from autotune.handoff.best_config import BestConfig

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
    "optimizer": "optimizer",  # LightningCLI's own section: class_path and init_args
}
# Lightning's precision plugins: (autotune precision, weights) -> Trainer(precision=...).
LIGHTNING_PRECISION = {
    ("fp32", "fp32"): "32-true",
    ("tf32", "fp32"): "32-true",
    ("bf16", "fp32"): "bf16-mixed",
    ("fp16", "fp32"): "16-mixed",
    ("bf16", "bf16"): "bf16-true",
    ("fp32", "bf16"): "bf16-true",
    ("tf32", "bf16"): "bf16-true",
}
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
        _put(
            doc,
            lt["strategy"],
            "ddp"
            if not sharding.is_fsdp(c.strategy)
            else {
                "class_path": "lightning.pytorch.strategies.FSDPStrategy",
                "init_args": {
                    "sharding_strategy": _FSDP_SHARDING[c.strategy],
                    "cpu_offload": sharding.offloads(c.strategy),
                    "state_dict_type": "full",
                },
            },
        )
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


def lightning_notes(best: BestConfig) -> list[str]:
    c = best.config
    said = [
        "data and model are your LightningDataModule's and LightningModule's __init__ arguments: these names are "
        "a convention; the model loads with attn_implementation and calls "
        'gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}) when '
        "gradient_checkpointing is true, as the probes did"
    ]
    if c.precision == "tf32":
        said.append('tf32: Lightning has no flag for it; call torch.set_float32_matmul_precision("high") before fit')
    if c.optimizer == "adafactor":
        said.append("adafactor: give optimizer.init_args.lr (relative_step is off, as Trainer's adafactor has it)")
    if c.compile:
        said.append(
            "torch.compile: compile the model yourself (model = torch.compile(model)) before fit, as the probes did"
        )
    if c.liger:
        said.append("Liger: apply liger_kernel's apply_liger_kernel_to_<model>() before building the model")
    if c.padding_free:
        said.append(
            "padding-free: your DataModule's collate_fn puts each batch's examples end to end, as the probes "
            "did: transformers.DataCollatorWithFlattening()"
        )
    if c.peft is not None:
        said.append(
            "LoRA: wrap the loaded model with peft.get_peft_model(model, peft.LoraConfig(**lora_config)) "
            "after turning checkpointing on"
        )
    if is_qlora(c.peft):
        said.append(
            "QLoRA: load the base with transformers.BitsAndBytesConfig(**model.quantization_config), keep "
            "precision off '-true' (bitsandbytes layers hold their own dtype)"
        )
    if evaluation.evaluates(c):
        eval_kwargs = best.eval_kwargs()
        if eval_kwargs.get("prediction_loss_only"):
            said.append("evaluation: return only the loss from validation_step, as the probe kept no logits")
        else:
            said.append(
                f"evaluation: the probe kept logits on the card for {c.eval_accumulation_steps} batch(es) "
                f"before moving them to the host: do the same in validation_step"
            )
        if evaluation.generates(c):
            said.append(
                f"generation at eval: call model.generate(max_length={c.generation_max_length}, "
                f"num_beams={c.generation_num_beams}, use_cache=True) in validation_step"
            )
    if c.ranks > 1 and sharding.is_fsdp(c.strategy):
        layers = ranks.layer_classes(c)
        wrap = f"{{{', '.join(layers)}}}" if layers else "the model's _no_split_modules"
        said.append(
            f"{c.strategy}: Lightning's FSDPStrategy is FSDP1 and the probes measured FSDP2 (fully_shard) "
            f"wrapping each of {wrap}: give FSDPStrategy(auto_wrap_policy={wrap}) in code (YAML cannot name a "
            f"set of classes), or use ModelParallelStrategy with fully_shard in configure_model"
        )
    return said
