"""`autotune best --update FILE`: the user's own config file with the winner's levers written in.

Only the keys of what the search decided change (micro-batch and accumulation, the eval batch it
found, precision, checkpointing, attention, compile, Liger, the multi-GPU strategy), with the values
`autotune best --format TOOL` gives them (autotune/handoff/tools.py); every other key, the comments
and the order stay as the user wrote them. The file must be the study's recipe: the model, sequence
length, effective batch, adapters and optimizer it asks are those the study measured, or nothing is
written.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.host.output import write_file
from autotune.vocabulary.errors import BadInput
from autotune.handoff import checkpointing_argument_names, tools
import autotune.recipe_files.yaml_edit as yaml_edit
from autotune.recipe_files.read import RecipeFile, read_recipe_file
from autotune.levers.lengths import DEFAULT_SAMPLING, Lengths
from autotune.levers.recipes import PeftSpec

if TYPE_CHECKING:
    from autotune.handoff import BestConfig

__all__ = ["DECIDED", "Update", "update_file", "write"]

# The keys each tool's file takes for the levers a search decides (the free levers, and the eval batch
# it finds): the rest of the tool's document is the recipe, which came from the file.
_TRAINER_DECIDED = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "tf32",
    "torch_compile",
    "use_liger_kernel",
    "fsdp",
    "fsdp_config",
    "ddp_find_unused_parameters",
)
DECIDED = {
    "axolotl": (
        "micro_batch_size",
        "eval_batch_size",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "tf32",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "attn_implementation",
        "torch_compile",
        *tools.AXOLOTL_LIGER_KEYS,
        "fsdp_version",
        "fsdp_config",
        "ddp_find_unused_parameters",
    ),
    "llamafactory": (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "tf32",
        "disable_gradient_checkpointing",
        "use_reentrant_gc",
        "flash_attn",
        "torch_compile",
        "enable_liger_kernel",
        "ddp_find_unused_parameters",
    ),
    "trl": _TRAINER_DECIDED,
    "trainer": _TRAINER_DECIDED,
}
# Keys each tool reads as false when absent (its source's defaults): the winner's false is not
# added to a file that leaves them out. (axolotl's bf16 and tf32 default to "auto", TRL's bf16 to
# on where the card has it, LLaMA-Factory's use_reentrant_gc to true: those are always written.)
_FALSE_BY_DEFAULT = {
    "axolotl": ("fp16", "torch_compile", *tools.AXOLOTL_LIGER_KEYS),
    "llamafactory": ("fp16", "bf16", "torch_compile", "enable_liger_kernel", "disable_gradient_checkpointing"),
    "trl": ("fp16", "torch_compile", "use_liger_kernel"),
    "trainer": ("fp16", "bf16", "torch_compile", "use_liger_kernel"),
}
# A lever the winner has off is absent from its document: a file that turns it on gets it off.
_OFF_WHEN_ABSENT = ("torch_compile", "use_liger_kernel", "enable_liger_kernel", *tools.AXOLOTL_LIGER_KEYS)
# axolotl's attention keys before attn_implementation (deprecated in its schema): one key says it.
_AXOLOTL_OLD_ATTENTION = ("flash_attention", "sdp_attention", "xformers_attention", "flex_attention", "sage_attention")
_CHECKPOINTING_NAMES = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)


@dataclass(frozen=True)
class Update:
    """The file as it was and as the winner has it; `diff` is what `best --update` prints."""

    source: RecipeFile
    text: str
    changed: tuple[str, ...]

    def diff(self, out: Path) -> str:
        return "".join(
            difflib.unified_diff(
                self.source.text.splitlines(keepends=True),
                self.text.splitlines(keepends=True),
                fromfile=str(self.source.path),
                tofile=str(out),
            )
        )


def update_file(best: BestConfig, path: str | Path) -> Update:
    """The file at `path` with `best`'s decided levers (BadInput when it is not the study's recipe)."""
    source = read_recipe_file(path, gpus=best.config.ranks, flag="--update")
    _check_same_recipe(source, best)
    updates, remove = _decided(source, best)
    if source.path.suffix.lower() == ".json":
        text = _edit_json(source, updates, remove)
    else:
        note = f"autotune: decided by study {best.row.study!r} (autotune best --update)"
        # axolotl's old attention key, where there is one, becomes attn_implementation in its place.
        renamed = {key: "attn_implementation" for key in remove if key in _AXOLOTL_OLD_ATTENTION}
        try:
            text = yaml_edit.edit(
                source.text, updates, remove, renamed=dict(list(renamed.items())[:1]), appended_note=note
            )
        except ValueError as exc:
            raise BadInput(
                f"{source.path}: {exc}; nothing was written: take `autotune best --format {source.tool}` and "
                f"set its keys by hand."
            ) from None
    changed = tuple(k for k in (*updates, *remove) if source.document.get(k, _MISSING) != updates.get(k, _MISSING))
    if changed and source.path.suffix.lower() != ".json":
        text = _with_header(text, changed, best)
    return Update(source, text, changed)


# The first line `best --update` writes into a YAML file: what it changed and where that was measured.
HEADER = "# autotune best --update: "


def _with_header(text: str, changed: tuple[str, ...], best: BestConfig) -> str:
    """`text` opened by one comment line saying which keys study S set and on what device it measured
    them (an earlier update's line replaced): in the file, beside any comment of the user's that
    described the old values (a file commented for A100s, updated from a CPU study, says so in itself,
    not only on a terminal's stderr)."""
    newline = "\r\n" if text.endswith("\r\n") else "\n"
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith(HEADER):
        lines = lines[1:]
    device = best.device_name or best.device_type
    where = f"on {device}" + (
        "; a CPU run's levers: search on the card for a GPU's" if best.device_type == "cpu" else ""
    )
    header = f"{HEADER}{', '.join(changed)} set by study {best.row.study!r}, measured {where}{newline}"
    return header + "".join(lines)


_MISSING = object()


def write(update: Update, out: Path, flag: str = "--update") -> Path:
    """Write `update` to `out` whole or not at all, as every file autotune writes is written
    (host/output.py: a regular file only, through a link to the file it points to, its mode kept, a
    new one made as the umask says). Line endings are the source file's."""
    text = update.text.replace("\n", "\r\n") if update.source.crlf else update.text
    return write_file(out, text, flag)


def _check_same_recipe(source: RecipeFile, best: BestConfig) -> None:
    """The file asks what the study measured, or the winner is not its answer."""
    c, flags, study = best.config, source.flags, best.row.study
    asked: list[tuple[str, object, object]] = []
    if "model" in flags and not _same_model(str(flags["model"]), c.model):
        asked.append(("the model", flags["model"], c.model))
    # (with the data's lengths a block above the longest example was probed at it: truncating at the
    # file's longer one cuts nothing more, SearchSpace.build)
    capped = (
        c.lengths is not None
        and int(flags.get("block_sizes", 0)) > best.block_size
        and Lengths.from_text(c.lengths).longest <= best.block_size
    )
    if "block_sizes" in flags and int(flags["block_sizes"]) != best.block_size and not capped:
        asked.append(("a sequence length", flags["block_sizes"], best.block_size))
    if source.effective_batch != c.effective_batch:
        asked.append(("an effective batch", source.effective_batch, c.effective_batch))
    file_peft = _peft(flags)
    study_peft = None if c.peft is None else PeftSpec.from_text(c.peft)
    if file_peft != study_peft:
        asked.append(
            ("adapters", file_peft.text() if file_peft else "none", study_peft.text() if study_peft else "none")
        )
    if flags["optimizers"] != c.optimizer:
        asked.append(("the optimizer", flags["optimizers"], c.optimizer))
    if flags.get("weights_", "fp32") != c.weights:
        asked.append(("weights in", flags.get("weights_", "fp32"), c.weights))
    if "eval_batch" in flags and best.eval_batch is None:
        asked.append(("evaluation", "on", "off"))
    if flags.get("packing") == "on" and c.lengths is not None:
        asked.append(("packing", "on", "one example per row, padded (packing off)"))
    if flags.get("sampling", DEFAULT_SAMPLING) != c.sampling:
        asked.append(("the sampler", flags.get("sampling", DEFAULT_SAMPLING), c.sampling))
    if flags.get("padding_free") == "on" and not c.padding_free:
        asked.append(("padding-free batches", "on", "padded ones"))
    if asked:
        what, file_value, study_value = asked[0]
        raise BadInput(
            f"{source.path} asks {what} {file_value}, and study {study!r} measured {study_value}: search "
            f"its recipe with `autotune search --from {source.path} --gpu-budget ...`."
        )


def _same_model(asked: str, measured: str) -> bool:
    if asked == measured:
        return True
    left, right = Path(asked).expanduser(), Path(measured).expanduser()
    return left.exists() and right.exists() and left.resolve() == right.resolve()


def _peft(flags: dict) -> PeftSpec | None:
    if "peft" not in flags:
        return None
    return PeftSpec(
        kind=str(flags["peft"]),
        rank=int(flags["lora_rank"]),
        alpha=int(flags["lora_alpha"]),
        dropout=float(flags["lora_dropout"]),
        targets=str(flags["lora_targets"]),
    )


def _decided(source: RecipeFile, best: BestConfig) -> tuple[dict, tuple[str, ...]]:
    """The keys to set, and those to delete, for the winner in this tool's file."""
    tool, document = source.tool, source.document
    rendered = best.trainer_kwargs() if tool == "trainer" else tools.tool_document(best, tool)
    decided = list(DECIDED[tool])
    if tool in ("trl", "trainer"):
        decided += list(checkpointing_argument_names())
    updates = {key: rendered[key] for key in decided if key in rendered}
    updates.update({key: False for key in _OFF_WHEN_ABSENT if key not in rendered and document.get(key)})
    for key in _FALSE_BY_DEFAULT[tool]:
        if updates.get(key, True) is False and key not in document:
            del updates[key]
    if "eval_batch" not in source.flags:
        for key in ("eval_batch_size", "per_device_eval_batch_size"):
            updates.pop(key, None)
    remove: tuple[str, ...] = ()
    if tool in ("trl", "trainer"):
        # Written under the name the file already uses (transformers 5.23 renamed it).
        for names in _CHECKPOINTING_NAMES:
            current = next((name for name in names if name in document), None)
            if current is not None:
                for name in names:
                    if name in updates and name != current:
                        updates[current] = updates.pop(name)
        if tool == "trl" and rendered.get(tools.TRL["padding_free"]):
            # (SFTTrainer cuts no example under padding_free, and refuses a max_length beside it)
            length_key = next((key for key in ("max_length", "max_seq_length") if key in document), "max_length")
            updates.update({tools.TRL["padding_free"]: True, length_key: None})
        if tool == "trl":
            attention = best.model_kwargs()["attn_implementation"]
            if "model_name_or_path" in document:  # `trl sft --config`: ModelConfig's key
                updates["attn_implementation"] = attention
            else:  # an SFTConfig: SFTTrainer loads the model with these
                updates["model_init_kwargs"] = {
                    **(document.get("model_init_kwargs") or {}),
                    "attn_implementation": attention,
                }
    if tool == "axolotl":
        remove = tuple(key for key in _AXOLOTL_OLD_ATTENTION if key in document)
        if "plugins" in rendered:
            plugins = list(document.get("plugins") or [])
            updates["plugins"] = plugins + [p for p in rendered["plugins"] if p not in plugins]
    return updates, remove


def _edit_json(source: RecipeFile, updates: dict, remove: tuple[str, ...]) -> str:
    document = {key: value for key, value in source.document.items() if key not in remove}
    document.update(updates)
    indent = _json_indent(source.text)
    return json.dumps(document, indent=indent) + ("\n" if source.text.endswith("\n") else "")


def _json_indent(text: str) -> int | None:
    for line in text.splitlines()[1:]:
        if line.strip():
            return len(line) - len(line.lstrip(" ")) or None
    return 2
