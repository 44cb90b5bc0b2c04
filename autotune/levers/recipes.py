"""Recipe levers beyond the task: the optimizer, the weights' dtype, PEFT (LoRA, QLoRA) and the
trainer the run uses.

They change what is trained (or, the trainer, what each step does), not only how fast, so the user
allows them (`--optimizers`, `--weights`, `--peft`, `--trainer`) and autotune never switches one by
itself. Torch-free: the CLI and the
store read these names; `autotune.probe.step` builds what they name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autotune.vocabulary.errors import BadInput


@dataclass(frozen=True, slots=True)
class Optimizer:
    optim: str  # TrainingArguments(optim=...): the hand-off is exact
    optim_args: str | None  # TrainingArguments(optim_args=...)
    needs: str | None  # the package it needs beyond torch and transformers
    what: str
    # Why the estimator cannot trace its step on fake tensors (None: it can).
    untraceable: str | None = None
    # Memory it holds that the budget's cap cannot hold (None: none), said wherever its result is shown.
    outside_cap: str | None = None


# Names are TrainingArguments' `optim` values, but for "adamw": the name probes stored before this
# lever existed (their keys hold it), meaning Trainer's adamw_torch_fused.
OPTIMIZERS = {
    "adamw": Optimizer("adamw_torch_fused", None, None, "AdamW (fused where the device has the kernel)"),
    # torch's default AdamW, as Trainer's adamw_torch and most custom loops make it: on CUDA its
    # foreach step allocates temporaries as large as the parameters (sqrt of the second moments,
    # then the update) for each parameter group, which the fused kernel does not.
    "adamw_torch": Optimizer(
        "adamw_torch", None, None, "AdamW, torch's default (foreach on CUDA: full-size temporaries in the step)"
    ),
    "adafactor": Optimizer("adafactor", None, None, "Adafactor (factored second moments, no first)"),
    "sgd": Optimizer("sgd", "momentum=0.9", None, "SGD with momentum 0.9"),
    "adamw_8bit": Optimizer("adamw_8bit", None, "bitsandbytes", "AdamW with 8-bit states (bitsandbytes)"),
    "paged_adamw_8bit": Optimizer(
        "paged_adamw_8bit",
        None,
        "bitsandbytes",
        "AdamW with 8-bit states in paged memory (bitsandbytes)",
        untraceable="its state lives in CUDA unified memory, outside PyTorch's allocator",
        outside_cap="its 8-bit state (about 2 bytes per trainable parameter) lives in CUDA "
        "unified memory, outside PyTorch's allocator: the cap does not hold it and "
        "the peak shown leaves it out; the driver pages it to host memory when the "
        "card is full, so the run slows down rather than failing",
    ),
}
DEFAULT_OPTIMIZER = "adamw"
# TrainingArguments' other names for the same optimizers: accepted, and stored under autotune's
# name (so that a study keyed by one is found by the other).
OPTIMIZER_ALIASES = {"adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit"}


def canonical_optimizer(name: str) -> str:
    """autotune's name for an optimizer given by TrainingArguments' name or its own (unknown names
    are returned as they are, for the caller's check to refuse)."""
    name = name.strip().lower()
    return OPTIMIZER_ALIASES.get(name, name)


def optimizer_names() -> str:
    """What `--optimizer` accepts, for messages and help."""
    return ", ".join([*OPTIMIZERS, *OPTIMIZER_ALIASES])


def memory_caveats(optimizer: str) -> list[str]:
    """What a result's memory figures leave out for this optimizer, one line each (none for most)."""
    outside = OPTIMIZERS[optimizer].outside_cap if optimizer in OPTIMIZERS else None
    return [f"{optimizer}: {outside}"] if outside else []


# fp32: master weights in fp32 (mixed precision autocasts over them); bf16: pure bf16, weights,
# gradients and optimizer state (a model loaded with dtype=torch.bfloat16 and trained so).
WEIGHTS = ("fp32", "bf16")
DEFAULT_WEIGHTS = "fp32"
PEFT_KINDS = ("lora", "qlora")

# The trainer the run uses (--trainer, or the tool a --from file is for): the probes time its step.
# transformers: Trainer and the trainers that keep its compute_loss (autotune train, axolotl,
# LLaMA-Factory). trl: TRL's SFTTrainer, whose loss runs a fused LM head (TRL's add_fused_lm_head:
# the log-probabilities in chunks, no full logits) that also computes each token's entropy and
# whether its top-1 is right, and reads three figures to the host every micro-step: more work per
# token than Trainer's step, and other memory (no full logits, but tiles of 32,768 vocabulary
# columns: less for gpt2's 50,257-token vocabulary, more for a small one).
TRAINERS = ("transformers", "trl")
DEFAULT_TRAINER = "transformers"
# The trainer each hand-off format runs (the formats not named run none: json, yaml, lightning).
FORMAT_TRAINERS = {
    "trl": "trl",
    "trainer-args": "transformers",
    "cli": "transformers",
    "accelerate": "transformers",
    "axolotl": "transformers",
    "llamafactory": "transformers",
}


def trainer_caveat(measured: str, runs: str, what: str) -> str | None:
    """What to tell a user whose run (`what`) takes `runs`'s step where the probes timed `measured`'s
    (None: the same trainer)."""
    if measured == runs:
        return None
    if measured == "trl":
        return (
            f"the probes timed TRL's SFTTrainer step (--trainer trl), and {what} runs transformers' Trainer, whose "
            f"step holds the full logits: its memory and speed were not measured; hand the pick to TRL "
            f"(--format trl), or search again with --trainer transformers"
        )
    return (
        f"the probes timed transformers' Trainer step, and {what} runs TRL's SFTTrainer, whose fused LM head also "
        f"scores each token's entropy and accuracy every micro-step: slower per token than measured, other memory; "
        f"search with --trainer trl (or --from your TRL file) to rank the configs by its step"
    )


def trainer_problems(trainer: str, task: str, flag: str = "--trainer") -> list[str]:
    """What is wrong with `trainer` for `task` (nothing: [])."""
    if trainer not in TRAINERS:
        return [f"{flag} {trainer!r} is unknown; choose from {', '.join(TRAINERS)}"]
    if trainer == "trl" and task != "causal-lm":
        return [f"{flag} trl is TRL's SFTTrainer, which trains causal LMs, not {task}; use {flag} transformers"]
    return []


# peft's task types, by task: the wrapper's forward and which head stays trainable (SEQ_CLS keeps
# the classifier's head). A masked LM has none: the base model's forward is called as it is.
PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM", "classification": "SEQ_CLS"}


# The heads peft trains whole for a task (its SEQ_CLS modules_to_save): a 4-bit base keeps them unquantized.
WHOLE_HEADS = {"classification": ["classifier", "score"]}


def bnb_4bit_kwargs(precision: str, task: str = "causal-lm") -> dict:
    """`transformers.BitsAndBytesConfig`'s arguments for QLoRA's base (--peft qlora), as the QLoRA
    paper trains it: NF4 with double quantization; the 4-bit layers compute in the precision's
    dtype (bf16 mixed precision: bfloat16; fp16: float16; else float32). A classifier's head,
    which trains whole, stays unquantized (`llm_int8_skip_modules`, which replaces transformers'
    default list: the output embeddings, which a classifier does not have)."""
    kwargs: dict = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32"),
    }
    if task in WHOLE_HEADS:
        kwargs["llm_int8_skip_modules"] = WHOLE_HEADS[task]
    return kwargs


def check_optimizer(name: str, flag: str = "--optimizer") -> str:
    canonical = canonical_optimizer(name)
    if canonical not in OPTIMIZERS:
        raise BadInput(f"{flag} {name!r} is unknown; choose from {optimizer_names()}.")
    return canonical


@dataclass(frozen=True, slots=True)
class PeftSpec:
    """LoRA adapters on a frozen base (`qlora`: the base's linear layers in 4 bits through bitsandbytes, CUDA only).
    Stored and keyed as its text, e.g. 'lora r=8 alpha=16 dropout=0.05 targets=all-linear'."""

    kind: str = "lora"
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05
    targets: str = "all-linear"  # peft's target_modules: 'all-linear' or comma-separated names

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in PEFT_KINDS:
            problems.append(f"--peft {self.kind!r} is unknown; choose from {', '.join(PEFT_KINDS)}")
        if not isinstance(self.rank, int) or not 1 <= self.rank <= 4096:
            problems.append(f"--lora-rank must be from 1 to 4096 (got {self.rank!r})")
        if not isinstance(self.alpha, int) or not 1 <= self.alpha <= 1 << 20:
            problems.append(f"--lora-alpha must be a whole number of at least 1 (got {self.alpha!r})")
        if not 0 <= self.dropout < 1:
            problems.append(f"--lora-dropout must be from 0 to below 1 (got {self.dropout!r})")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*", self.targets or ""):
            problems.append(f"--lora-targets {self.targets!r}: give all-linear or module names separated by commas")
        if problems:
            raise BadInput("; ".join(problems) + ".")

    @property
    def target_modules(self) -> str | list[str]:
        return self.targets if self.targets == "all-linear" else self.targets.split(",")

    def text(self) -> str:
        return f"{self.kind} r={self.rank} alpha={self.alpha} dropout={self.dropout:g} targets={self.targets}"

    def label(self) -> str:
        return f"{self.kind}-r{self.rank}"

    def lora_kwargs(self) -> dict:
        """peft.LoraConfig's arguments (task_type is the caller's: it depends on the task)."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules,
        }

    @classmethod
    def from_text(cls, text: str) -> PeftSpec:
        kind, *pairs = text.split()
        values = dict(pair.split("=", 1) for pair in pairs)
        return cls(
            kind=kind,
            rank=int(values["r"]),
            alpha=int(values["alpha"]),
            dropout=float(values["dropout"]),
            targets=values["targets"],
        )


def is_qlora(peft: str | None) -> bool:
    """Whether the stored --peft text (None: full fine-tuning) is QLoRA: a 4-bit base."""
    return peft is not None and PeftSpec.from_text(peft).kind == "qlora"


def peft_text(
    kind: str | None,
    rank: int | None = None,
    alpha: int | None = None,
    dropout: float | None = None,
    targets: str | None = None,
) -> str | None:
    """The stored form of the user's --peft flags (None without --peft); BadInput for bad values,
    and for LoRA flags given without --peft."""
    given = {"--lora-rank": rank, "--lora-alpha": alpha, "--lora-dropout": dropout, "--lora-targets": targets}
    if kind is None:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise BadInput(f"{', '.join(stray)} only apply with --peft lora or qlora; add --peft or leave them out.")
        return None
    default = PeftSpec()
    return PeftSpec(
        kind=kind.strip().lower(),
        rank=rank if rank is not None else default.rank,
        alpha=alpha if alpha is not None else default.alpha,
        dropout=dropout if dropout is not None else default.dropout,
        targets=(targets or default.targets).replace(" ", ""),
    ).text()
