"""`autotune search --from FILE`: the recipe of a config the user already has, as search's own flags.

A TRL config (SFTConfig's fields, with ModelConfig's when it is `trl sft --config`'s YAML), an axolotl
YAML, a LLaMA-Factory YAML or a TrainingArguments JSON says what is trained: the model, the sequence
length, the effective batch (micro-batch x accumulation x ranks), LoRA/QLoRA, the optimizer, bf16
weights, evaluation, and (a TRL file) that SFTTrainer's step is the one to time. Those become the
flags that fix the search's recipe (`--model`, `--block-sizes`, `--effective-batch`, `--peft`...,
`--trainer trl`), so the command line's own checks read them; the free levers the file also sets
(its micro-batch, precision, checkpointing, attention, compile) are what the search is for, and are
searched. What the file asks that autotune cannot measure is refused in one line when
it changes what is trained (another adapter, a reward stage, an 8-bit base); what it can only
approximate is said, one line each, before anything runs.

Each tool's keys and defaults are read from its source (named beside each table in
autotune/handoff/tools.py, which writes the same keys). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from autotune.host.config_files import parse_config, read_config_text
from autotune.vocabulary.errors import BadInput
from autotune.levers.lengths import DEFAULT_SAMPLING, SAMPLINGS
from autotune.levers.recipes import OPTIMIZERS, canonical_optimizer, optimizer_names

__all__ = ["RecipeFile", "TOOLS", "read_recipe_file"]

# The tools a file may be for, as `best --update` and the messages name them.
TOOLS = {"trl": "TRL", "axolotl": "axolotl", "llamafactory": "LLaMA-Factory", "trainer": "TrainingArguments"}

# Keys only one tool's files have (each tool's config classes), to tell which tool a file is for.
_MARKERS = {
    "axolotl": (
        "base_model",
        "micro_batch_size",
        "sequence_len",
        "adapter",
        "val_set_size",
        "lora_target_linear",
        "sample_packing",
        "pad_to_sequence_len",
        "eval_batch_size",
        "base_model_config",
    ),
    "llamafactory": (
        "stage",
        "finetuning_type",
        "cutoff_len",
        "template",
        "lora_rank",
        "lora_target",
        "quantization_bit",
        "flash_attn",
        "dataset_dir",
        "val_size",
        "pure_bf16",
        "neat_packing",
    ),
    "trl": (
        "max_length",
        "max_seq_length",
        "padding_free",
        "dataset_text_field",
        "completion_only_loss",
        "assistant_only_loss",
        "model_init_kwargs",
        "use_peft",
        "dataset_name",
        "packing_strategy",
    ),
}
# TrainingArguments' own keys: a file with only these is a TrainingArguments JSON.
_TRAINER_MARKERS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "output_dir",
    "optim",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "eval_strategy",
)
# TrainingArguments' defaults (transformers 5), which TRL's SFTConfig and LLaMA-Factory keep.
_HF_MICRO_BATCH, _HF_EVAL_BATCH, _HF_OPTIM = 8, 8, "adamw_torch_fused"


@dataclass(frozen=True)
class RecipeFile:
    """A user's config file, read: `flags` are `autotune search`'s parameters it sets (click's names,
    values as the command line gives them), `sources` the file's keys each came from, `said` what it
    asks that the measurement can only approximate (one line each)."""

    path: Path
    tool: str
    text: str
    document: dict
    flags: dict[str, str | bool] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    said: tuple[str, ...] = ()
    crlf: bool = False  # its lines end with \r\n (written back so)

    @property
    def effective_batch(self) -> int:
        return int(self.flags["effective_batch"])


def read_recipe_file(path: str | Path, *, gpus: int = 1, flag: str = "--from") -> RecipeFile:
    """The file at `path`, read for `--from` (BadInput, one line, for a file autotune cannot use).
    `gpus`: the ranks the run has (the effective batch counts each; no file of these says how many);
    `flag`: the option that named the file, as the messages name it."""
    path = Path(path).expanduser()
    text, crlf = read_config_text(path, flag)  # (bounded: host/config_files.py)
    document = _parse(path, text, flag)
    tool = detect_tool(path, document, flag)
    reader = _READERS[tool]
    recipe = _Recipe(path, document, flag)
    reader(recipe)
    return dataclasses.replace(recipe.finish(tool, text, gpus), crlf=crlf)


def _parse(path: Path, text: str, flag: str) -> dict:
    document = parse_config(path, text, flag)
    if not isinstance(document, dict):
        kind = "empty" if document is None else f"a {type(document).__name__}"
        raise BadInput(f"{flag} {path}: the file is {kind}, not a mapping of a config's keys to values.")
    return document


def detect_tool(path: Path, document: dict, flag: str = "--from") -> str:
    """Which tool `document` configures, by the keys only that tool has."""
    if isinstance(document.get("trainer"), dict) or "fit" in document:
        raise BadInput(
            f"{flag} {path}: a LightningCLI config names a LightningModule, not a model autotune can load; "
            f"give --model and the recipe's flags, and take `autotune best --format lightning` back."
        )
    found = {tool: [key for key in keys if key in document] for tool, keys in _MARKERS.items()}
    tools = [tool for tool, keys in found.items() if keys]
    if len(tools) == 1:
        return tools[0]
    if len(tools) > 1:
        mixed = "; ".join(f"{TOOLS[t]}: {', '.join(found[t])}" for t in tools)
        raise BadInput(f"{flag} {path}: it has keys of several tools ({mixed}); keep the one tool's keys.")
    if any(key in document for key in _TRAINER_MARKERS):
        return "trainer"
    raise BadInput(
        f"{flag} {path}: none of the keys of a TRL, axolotl, LLaMA-Factory or TrainingArguments config "
        f"(such as base_model, model_name_or_path, per_device_train_batch_size): autotune reads those tools' "
        f"files."
    )


class _Recipe:
    """What a reader found, in autotune's terms, and the checks every tool shares."""

    def __init__(self, path: Path, document: dict, flag: str) -> None:
        self.path, self.document, self.flag = path, document, flag
        self.model: str | None = None
        self.block: int | None = None
        self.micro, self.accum = 1, 1
        self.batch_keys = ""
        self.stated_batch: tuple[str, int] | None = None  # a global batch the file states beside micro x accumulation
        self.peft: dict | None = None  # kind, rank, alpha, dropout, targets
        self.optimizer = _HF_OPTIM
        self.bf16_weights = False
        self.evaluation: dict[str, str | bool] = {}
        self.trust_remote_code = False
        self.trainer: str | None = None  # whose step the run takes, where not transformers' Trainer's
        self.packing: bool | None = None  # examples packed into full blocks (True), or one per row, padded
        self.sampling: str | None = (
            None  # the run's sampler (autotune.levers.lengths.SAMPLINGS), where the file sets one
        )
        self.padding_free: bool | None = (
            None  # examples end to end, unpadded (TRL's padding_free), where the file sets it
        )
        self.sources: dict[str, str] = {}
        self.said: list[str] = []

    # --- reading values ---
    def get(self, key: str, default=None):
        return self.document.get(key, default)

    def whole(self, key: str, default: int | None = None, *, at_least: int = 1) -> int | None:
        value = self.document.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
            raise BadInput(f"{self.flag} {self.path}: {key}: {value!r} is not a whole number of at least {at_least}.")
        return value

    def count(self, key: str, default: int) -> int:
        """`whole`, where the tool has a default for the key."""
        value = self.whole(key)
        return default if value is None else value

    def refuse(self, what: str) -> None:
        raise BadInput(f"{self.flag} {self.path}: {what}")

    def say(self, line: str) -> None:
        self.said.append(f"{self.path.name}: {line}")

    def set_optimizer(self, key: str, default: str) -> None:
        name = self.get(key, default)
        if not isinstance(name, str) or canonical_optimizer(name) not in OPTIMIZERS:
            self.refuse(
                f"{key}: {name!r}: autotune measures {optimizer_names()}; set one of them, or search without --from."
            )
        self.optimizer = canonical_optimizer(name)
        self.sources["optimizers"] = key if key in self.document else f"{key} (default {default})"

    # --- the flags ---
    def finish(self, tool: str, text: str, gpus: int) -> RecipeFile:
        flags: dict[str, str | bool] = {}
        if self.model is not None:
            if not isinstance(self.model, str) or not self.model.strip():
                self.refuse(f"the model ({self.sources.get('model')}) is not a name or a directory.")
            flags["model"] = self.model
        if self.block is not None:
            flags["block_sizes"] = str(self.block)
        effective = self.micro * self.accum
        if self.stated_batch is not None and self.stated_batch[1] != effective:
            key, stated = self.stated_batch
            self.refuse(
                f"{key}: {stated} contradicts {self.batch_keys} = {self.micro} x {self.accum} = {effective}; "
                f"make them agree (or leave {key} out)."
            )
        flags["effective_batch"] = str(effective * gpus)
        self.sources["effective_batch"] = self.batch_keys + (f" x {gpus} GPUs (--gpus)" if gpus > 1 else "")
        if self.peft is not None:
            flags.update(
                {
                    "peft": self.peft["kind"],
                    "lora_rank": str(self.peft["rank"]),
                    "lora_alpha": str(self.peft["alpha"]),
                    "lora_dropout": str(self.peft["dropout"]),
                    "lora_targets": self.peft["targets"],
                }
            )
        flags["optimizers"] = self.optimizer
        if self.bf16_weights:
            flags["weights_"] = "bf16"
        flags.update(self.evaluation)
        if self.trust_remote_code:
            flags["trust_remote_code"] = True
        if self.trainer is not None:
            flags["trainer"] = self.trainer
        if self.packing is not None:
            flags["packing"] = "on" if self.packing else "off"
        if self.sampling is not None:
            flags["sampling"] = self.sampling
        if self.padding_free is not None:
            flags["padding_free"] = "on" if self.padding_free else "off"
        return RecipeFile(self.path, tool, text, self.document, flags, dict(self.sources), tuple(self.said))


def _targets(recipe: _Recipe, key: str, value, *, all_names: tuple[str, ...]) -> str:
    """LoRA's target modules as --lora-targets takes them: all-linear, or comma-separated names."""
    if value is None:
        recipe.say(
            f"{key} is not given: peft then picks the model type's default modules; the probes put adapters on "
            f"every linear layer (at least as much memory): set {key} to measure exactly yours."
        )
        return "all-linear"
    if isinstance(value, str) and value.strip().lower() in all_names:
        return "all-linear"
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        recipe.refuse(f"{key}: {value!r} is neither a module name, a list of them, nor all-linear.")
    return ",".join(n.strip() for n in names)


def _lora_number(recipe: _Recipe, key: str, default, kind=int):
    value = recipe.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        recipe.refuse(f"{key}: {value!r} is not a number.")
    return value


# --- axolotl (AxolotlInputConfig: utils/schemas/{config,training,peft,model}.py) ------------------------


def _axolotl(r: _Recipe) -> None:
    r.model = r.get("base_model")
    r.sources["model"] = "base_model"
    r.block = r.whole("sequence_len", 512)
    r.sources["block_sizes"] = "sequence_len" if "sequence_len" in r.document else "sequence_len (default 512)"
    r.micro, r.accum = r.count("micro_batch_size", 1), r.count("gradient_accumulation_steps", 1)
    r.batch_keys = "micro_batch_size x gradient_accumulation_steps"
    if (stated := r.whole("batch_size")) is not None:
        r.stated_batch = ("batch_size", stated)
    if r.get("rl") not in (None, False):
        r.refuse(
            f"rl: {r.get('rl')!r}: autotune measures supervised fine-tuning (no reference model, no preference "
            f"pairs); search the SFT stage, or without --from."
        )
    adapter = r.get("adapter")
    if r.get("load_in_8bit"):
        r.refuse("load_in_8bit: an 8-bit base is not among what autotune measures (full, LoRA, QLoRA's 4-bit base).")
    if adapter not in (None, "lora", "qlora"):
        r.refuse(
            f"adapter: {adapter!r}: autotune measures LoRA and QLoRA adapters (adapter: lora or qlora), or full "
            f"fine-tuning (no adapter)."
        )
    if r.get("load_in_4bit") and adapter != "qlora":
        r.refuse(f"load_in_4bit: true with adapter: {adapter!r}: a 4-bit base is axolotl's adapter: qlora.")
    if adapter == "qlora" and not r.get("load_in_4bit", True):
        r.refuse("adapter: qlora with load_in_4bit: false: QLoRA's base is 4-bit; set load_in_4bit: true.")
    if adapter is not None:
        linear = bool(r.get("lora_target_linear"))
        r.peft = {
            "kind": adapter,
            "rank": _lora_number(r, "lora_r", 8),
            "alpha": _lora_number(r, "lora_alpha", 8),
            "dropout": _lora_number(r, "lora_dropout", 0.0, float),
            "targets": "all-linear"
            if linear
            else _targets(r, "lora_target_modules", r.get("lora_target_modules"), all_names=("all-linear",)),
        }
        r.sources["peft"] = "adapter, lora_r, lora_alpha, lora_dropout, lora_target_" + (
            "linear" if linear else "modules"
        )
        for key in ("lora_modules_to_save", "peft_layers_to_transform", "lora_target_parameters"):
            if r.get(key):
                r.say(f"{key}: the probes put adapters on the target modules only; what {key} adds is not measured.")
    if r.get("unfrozen_parameters"):
        r.refuse("unfrozen_parameters: training a subset of the weights is not among what autotune measures.")
    r.set_optimizer("optimizer", "adamw_torch_fused")
    r.bf16_weights = bool(r.get("bfloat16"))
    if r.get("val_set_size") or r.get("test_datasets"):
        r.evaluation["eval_batch"] = str(r.whole("eval_batch_size")) if "eval_batch_size" in r.document else "auto"
        r.sources["eval_batch"] = (
            "eval_batch_size" if "eval_batch_size" in r.document else "val_set_size (eval batch: auto)"
        )
    r.trust_remote_code = bool(r.get("trust_remote_code"))
    _read_packing(r, "sample_packing", default=False)
    _read_sampling(r)
    if not r.packing and r.get("pad_to_sequence_len"):
        r.packing, r.sources["packing"] = True, "pad_to_sequence_len (every row padded to sequence_len: full rows)"
    _say_ranks(r, ("deepspeed", "fsdp", "fsdp_config"))


def _read_packing(r: _Recipe, key: str, *, default: bool) -> None:
    """The file's packing: examples packed into full blocks, or one per row padded to the batch's
    longest (whose speed depends on the data's lengths: autotune.levers.lengths); the tool's default where
    the file says nothing. TRL's padding_free (each micro-batch's examples end to end) is read beside
    it (_trl)."""
    value = r.get(key)
    if value is not None and not isinstance(value, bool):
        r.refuse(f"{key}: {value!r} is not true or false.")
    r.packing = default if value is None else value
    r.sources["packing"] = key if value is not None else f"{key} (default {str(default).lower()})"


# --- LLaMA-Factory (hparams/{model,data,finetuning,training}_args.py) ----------------------------------


def _llamafactory(r: _Recipe) -> None:
    r.model = r.get("model_name_or_path")
    r.sources["model"] = "model_name_or_path"
    stage = r.get("stage", "sft")
    if stage not in ("sft", "pt"):
        r.refuse(
            f"stage: {stage!r}: autotune measures supervised fine-tuning and pre-training (stage sft or pt), "
            f"not a reward model or preference training."
        )
    r.block = r.whole("cutoff_len", 2048)
    r.sources["block_sizes"] = "cutoff_len" if "cutoff_len" in r.document else "cutoff_len (default 2048)"
    _trainer_batch(r)
    kind = r.get("finetuning_type", "lora")
    if kind not in ("lora", "full"):
        r.refuse(
            f"finetuning_type: {kind!r}: autotune measures full fine-tuning and LoRA (finetuning_type full or lora)."
        )
    for key in ("use_dora", "pissa_init", "use_galore", "use_badam", "use_apollo"):
        if r.get(key):
            r.refuse(f"{key}: true: not among what autotune measures (full fine-tuning, LoRA, QLoRA); leave it out.")
    bits = r.get("quantization_bit")
    if bits not in (None, 4):
        r.refuse(f"quantization_bit: {bits!r}: autotune measures a 4-bit base (QLoRA) or none.")
    if bits == 4 and kind != "lora":
        r.refuse("quantization_bit: 4 with finetuning_type full: a 4-bit base trains adapters (finetuning_type lora).")
    if kind == "lora":
        rank = _lora_number(r, "lora_rank", 8)
        r.peft = {
            "kind": "qlora" if bits == 4 else "lora",
            "rank": rank,
            "alpha": _lora_number(r, "lora_alpha", 2 * rank),
            "dropout": _lora_number(r, "lora_dropout", 0.0, float),
            "targets": _targets(r, "lora_target", r.get("lora_target", "all"), all_names=("all", "all-linear")),
        }
        r.sources["peft"] = "finetuning_type, lora_rank, lora_alpha, lora_dropout, lora_target, quantization_bit"
        if r.get("additional_target"):
            r.say(
                "additional_target: the probes put adapters on the target modules only; the modules it trains in "
                "full are not measured."
            )
    r.set_optimizer("optim", _HF_OPTIM)
    r.bf16_weights = bool(r.get("pure_bf16"))
    if r.get("do_eval") or r.get("val_size") or r.get("eval_dataset") or r.get("eval_strategy") not in (None, "no"):
        _trainer_evaluation(r)
    r.trust_remote_code = bool(r.get("trust_remote_code"))
    # (packing: off for sft and on for pt where unset, as LLaMA-Factory's data_args decide it)
    _read_packing(r, "packing", default=stage == "pt")
    if r.get("neat_packing"):
        r.packing, r.sources["packing"] = True, "neat_packing"
        r.say("neat_packing: the probes measured full cutoff_len blocks, which packed batches are.")
    _say_ranks(r, ("deepspeed", "fsdp", "fsdp_config"))


# --- TRL (SFTConfig, and ModelConfig in `trl sft --config`'s YAML) ---------------------------------------


def _trl(r: _Recipe) -> None:
    r.trainer, r.sources["trainer"] = "trl", "being a TRL config (SFTTrainer's step)"
    if "model_name_or_path" in r.document:
        r.model, r.sources["model"] = r.get("model_name_or_path"), "model_name_or_path"
    if "max_length" in r.document or "max_seq_length" not in r.document:
        r.block = r.whole("max_length", 1024)
        r.sources["block_sizes"] = "max_length" if "max_length" in r.document else "max_length (default 1024)"
    else:
        r.block = r.whole("max_seq_length")
        r.sources["block_sizes"] = "max_seq_length"
        r.say("max_seq_length is TRL's name before 0.20: read as max_length, which `best --update` writes.")
    _trainer_batch(r)
    init = r.get("model_init_kwargs") or {}
    if not isinstance(init, dict):
        r.refuse(f"model_init_kwargs: {init!r} is not a mapping.")
    if r.get("use_peft") or r.get("load_in_4bit"):
        if r.get("load_in_8bit"):
            r.refuse(
                "load_in_8bit: an 8-bit base is not among what autotune measures (full, LoRA, QLoRA's 4-bit base)."
            )
        if r.get("use_dora"):
            r.refuse("use_dora: true: DoRA is not among what autotune measures (LoRA, QLoRA); leave it out.")
        if r.get("load_in_4bit") and not r.get("use_peft"):
            r.refuse("load_in_4bit: true without use_peft: a 4-bit base trains LoRA adapters; set use_peft: true.")
        r.peft = {
            "kind": "qlora" if r.get("load_in_4bit") else "lora",
            "rank": _lora_number(r, "lora_r", 16),
            "alpha": _lora_number(r, "lora_alpha", 32),
            "dropout": _lora_number(r, "lora_dropout", 0.05, float),
            "targets": _targets(r, "lora_target_modules", r.get("lora_target_modules"), all_names=("all-linear",)),
        }
        r.sources["peft"] = "use_peft, lora_r, lora_alpha, lora_dropout, lora_target_modules, load_in_4bit"
    r.set_optimizer("optim", _HF_OPTIM)
    dtype = r.get("dtype", init.get("dtype", init.get("torch_dtype")))
    r.bf16_weights = dtype in ("bfloat16", "bf16")
    if r.get("do_eval") or r.get("eval_strategy") not in (None, "no"):
        _trainer_evaluation(r)
    r.trust_remote_code = bool(r.get("trust_remote_code", init.get("trust_remote_code")))
    _read_packing(r, "packing", default=False)
    if not r.packing and r.get("padding_free") is not None:
        # (with packing, TRL's bfd packing makes its blocks padding-free anyway: autotune times full blocks)
        if not isinstance(r.get("padding_free"), bool):
            r.refuse(f"padding_free: {r.get('padding_free')!r} is not true or false.")
        r.padding_free, r.sources["padding_free"] = r.get("padding_free"), "padding_free"
    _say_ranks(r, ("fsdp", "fsdp_config", "deepspeed"))


# --- TrainingArguments (a JSON of its fields) ------------------------------------------------------------


def _trainer(r: _Recipe) -> None:
    _trainer_batch(r)
    r.set_optimizer("optim", _HF_OPTIM)
    if r.get("do_eval") or r.get("eval_strategy") not in (None, "no"):
        _trainer_evaluation(r)
    if r.get("predict_with_generate"):
        r.evaluation["generate"] = True
        for key, flag in (("generation_max_length", "generation_max_length"), ("generation_num_beams", "num_beams")):
            if (value := r.whole(key)) is not None:
                r.evaluation[flag] = str(value)
    _say_ranks(r, ("fsdp", "fsdp_config", "deepspeed"))


def _trainer_batch(r: _Recipe) -> None:
    r.micro = r.count("per_device_train_batch_size", _HF_MICRO_BATCH)
    r.accum = r.count("gradient_accumulation_steps", 1)
    r.batch_keys = "per_device_train_batch_size x gradient_accumulation_steps"
    _read_sampling(r)


def _read_sampling(r: _Recipe) -> None:
    """The run's sampler: TrainingArguments' `train_sampling_strategy` (transformers 5's), or the older
    `group_by_length` (axolotl's and LLaMA-Factory's key too); random where the file says nothing."""
    strategy, grouped = r.get("train_sampling_strategy"), r.get("group_by_length")
    if strategy is not None:
        if strategy not in SAMPLINGS:
            r.refuse(
                f"train_sampling_strategy: {strategy!r}: autotune times {' and '.join(SAMPLINGS)} sampling; set "
                f"one of them, or search without --from."
            )
        r.sampling, r.sources["sampling"] = strategy, "train_sampling_strategy"
    elif grouped is not None:
        if not isinstance(grouped, bool):
            r.refuse(f"group_by_length: {grouped!r} is not true or false.")
        r.sampling = "group_by_length" if grouped else DEFAULT_SAMPLING
        r.sources["sampling"] = "group_by_length"


def _trainer_evaluation(r: _Recipe) -> None:
    """TrainingArguments' evaluation: its batch, and logits kept on the card when the file keeps them
    (eval_accumulation_steps) or asks for none (prediction_loss_only)."""
    r.evaluation["eval_batch"] = str(r.whole("per_device_eval_batch_size", _HF_EVAL_BATCH))
    r.sources["eval_batch"] = (
        "per_device_eval_batch_size"
        if "per_device_eval_batch_size" in r.document
        else f"per_device_eval_batch_size (default {_HF_EVAL_BATCH})"
    )
    if r.get("prediction_loss_only"):
        r.evaluation["eval_logits"] = "loss-only"
    elif (steps := r.whole("eval_accumulation_steps")) is not None:
        r.evaluation.update({"eval_logits": "kept", "eval_accumulation_steps": str(steps)})


def _say_ranks(r: _Recipe, keys: tuple[str, ...]) -> None:
    for key in keys:
        if r.get(key):
            what = (
                "DeepSpeed: the probes measure DDP and FSDP2, not DeepSpeed's ZeRO"
                if key == "deepspeed"
                else "the file shards over several GPUs"
            )
            r.say(f"{key}: {what}; give --gpus N (and --nodes) so the search shares the run as it will.")
            return


_READERS = {"axolotl": _axolotl, "llamafactory": _llamafactory, "trl": _trl, "trainer": _trainer}
