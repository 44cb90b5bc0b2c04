"""ProbeConfig: one training configuration, the unit that autotune measures and ranks."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, fields

from autotune.vocabulary import defaults
import autotune.levers.evaluation as evaluation
import autotune.levers.recipes as recipes
import autotune.levers.sharding as sharding
import autotune.levers.speed_levers as speed_levers
import autotune.levers.lengths as data_lengths
from autotune.vocabulary.errors import BadInput
from autotune.levers.tasks import FIXED_RECIPE, TASKS, Task
from autotune.vocabulary.units import INT64_MAX

# tf32: fp32 weights and math, matmuls and convolutions on TF32 tensor cores (NVIDIA Ampere and
# newer), as TrainingArguments(tf32=True) sets; the memory of fp32.
PRECISIONS = ("fp32", "fp16", "bf16", "tf32")
# Attention kernels by their transformers `attn_implementation` names. Others (flash_attention_2,
# flex_attention, ...) are accepted when installed; the worker reports `skipped` where they are not.
ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
OPTIMIZERS = tuple(recipes.OPTIMIZERS)

# Bump when the meaning of a field changes, so that stored keys of the old form are not reused.
KEY_VERSION = "p1"
# Fields added after KEY_VERSION p1 (the recipe fields, the weights' dtype, the speed levers) are left out of the key
# at the value that means what a p1 config meant, so that the keys (and stored probes) of causal-LM
# configs stay valid.
_LATER_FIELDS = {
    **FIXED_RECIPE,
    "weights": recipes.DEFAULT_WEIGHTS,
    "compile": False,
    "allocator": speed_levers.DEFAULT_ALLOCATOR,
    "liger": False,
    "gpus": 1,
    "strategy": None,
    "nodes": 1,
    "sampling": data_lengths.DEFAULT_SAMPLING,
    "padding_free": False,
}

# Tasks whose batches can be drawn from the data's lengths, each padded to its longest row: a
# classifier (DataCollatorWithPadding) and a causal LM trained per example (TRL's packing=False).
# A seq2seq pair has two lengths; its probe keeps the worst batch for now.
LENGTHS_TASKS = (Task.CAUSAL_LM.value, Task.CLASSIFICATION.value)
PADDING_FREE_NEEDS = "it is for a causal LM trained per example (--task causal-lm --packing off with --dataset)"


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """The levers of one training configuration of one model.

    `grad_accum` micro-steps of `micro_batch` sequences of `block_size` tokens make one optimizer
    step. Precision `fp16`/`bf16` is mixed precision (fp32 master weights, autocast; fp16 with a
    gradient scaler), as `transformers.Trainer` does with `fp16=True`/`bf16=True`.

    `task` decides the model class and the batch (autotune.levers.tasks): a seq2seq sequence is
    `block_size` source tokens and `target_length` target tokens; a classification head has
    `num_labels` outputs. Both are None for the tasks without them.
    """

    model: str
    micro_batch: int
    block_size: int
    grad_accum: int = 1
    precision: str = defaults.PRECISION
    checkpointing: bool = False
    attention: str = defaults.ATTENTION
    optimizer: str = defaults.OPTIMIZER
    task: str = Task.CAUSAL_LM.value
    target_length: int | None = None
    num_labels: int | None = None
    weights: str = recipes.DEFAULT_WEIGHTS  # fp32 master weights, or pure bf16 (autotune.levers.recipes)
    peft: str | None = None  # LoRA/QLoRA adapters on a frozen base: recipes.PeftSpec's text
    trainer: str = recipes.DEFAULT_TRAINER  # whose step the run takes: transformers' Trainer or TRL's SFTTrainer
    # Speed levers that keep the math (autotune.levers.speed_levers).
    compile: bool = False  # torch.compile (inductor) of the model
    allocator: str = speed_levers.DEFAULT_ALLOCATOR  # the CUDA caching allocator's setting
    liger: bool = False  # Liger's kernels, fused linear + cross-entropy among them
    # The run's evaluation (autotune.levers.evaluation), as TrainingArguments names it: None, no eval phase.
    eval_batch: int | None = None  # per_device_eval_batch_size (with auto_eval_batch: the largest tried)
    auto_eval_batch: bool = False  # the probe finds the largest eval batch that fits (result.eval_batch_found)
    eval_logits: str = evaluation.LOSS_ONLY  # loss-only, or kept: logits held on the card...
    eval_accumulation_steps: int | None = None  # ...for this many eval batches, then moved to the host
    generation_max_length: int | None = None  # seq2seq: predict_with_generate up to this many tokens
    generation_num_beams: int = 1
    # Ranks (one GPU each) sharing the run, and how they share it (autotune.levers.sharding): a free lever.
    gpus: int = 1  # ranks on each node
    strategy: str | None = None  # ddp, fsdp, ...; None on one GPU
    nodes: int = 1  # machines of `gpus` ranks each (torchrun's rendezvous)
    # The data's example lengths (autotune.levers.lengths' text form): batches drawn from them, each padded
    # to its longest row, are timed, and throughput counts their real tokens. None: every row is
    # full (a causal LM's packed blocks, or a padded task's worst batch where no data was given).
    lengths: str | None = None
    sampling: str = data_lengths.DEFAULT_SAMPLING  # the run's sampler: random, or group_by_length (a recipe lever)
    # Each micro-batch's examples end to end in one row, no padding, each attending only to itself
    # (TRL's padding_free, transformers' DataCollatorWithFlattening): a causal LM trained per example.
    padding_free: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, str):  # (TrainingArguments' names for the same optimizers)
            object.__setattr__(self, "optimizer", recipes.canonical_optimizer(self.optimizer))
        if (
            self.strategy is None
            and isinstance(self.gpus, int)
            and isinstance(self.nodes, int)
            and self.gpus * self.nodes > 1
        ):
            object.__setattr__(self, "strategy", sharding.DEFAULT_STRATEGY)
        problems = []
        if not self.model:
            problems.append("--model is empty; give a hub id, gpt2-family name or a local directory")
        for name, flag in (
            ("micro_batch", "--micro-batch"),
            ("block_size", "--block-size"),
            ("grad_accum", "--grad-accum"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{flag} must be a whole number of at least 1 (got {value!r})")
            elif value > INT64_MAX:  # the database stores 64-bit integers
                problems.append(f"{flag} {value} is too large (at most {INT64_MAX})")
        if self.precision not in PRECISIONS:
            problems.append(f"--precision {self.precision!r} is unknown; choose from {', '.join(PRECISIONS)}")
        if self.attention not in ATTENTIONS:
            problems.append(f"--attention {self.attention!r} is unknown; choose from {', '.join(ATTENTIONS)}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"--optimizer {self.optimizer!r} is unknown; choose from {recipes.optimizer_names()}")
        if self.weights not in recipes.WEIGHTS:
            problems.append(f"--weights {self.weights!r} is unknown; choose from {', '.join(recipes.WEIGHTS)}")
        elif self.weights == "bf16" and self.precision == "fp16":
            problems.append("--weights bf16 trains in bf16: use --precision bf16 (or fp32: no autocast), not fp16")
        if self.allocator not in speed_levers.ALLOCATORS:
            problems.append(
                f"--allocator {self.allocator!r} is unknown; choose from {', '.join(speed_levers.ALLOCATORS)}"
            )
        for name in ("compile", "liger"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false (got {getattr(self, name)!r})")
        if self.peft is not None:
            try:
                recipes.PeftSpec.from_text(self.peft)
            except (ValueError, KeyError) as exc:
                problems.append(f"--peft {self.peft!r} cannot be read ({exc})")
        problems += sharding.strategy_problems(self.gpus, self.strategy, self.nodes)
        if self.ranks > 1 and recipes.is_qlora(self.peft):
            problems.append(
                "--peft qlora with --gpus 2 or more is not supported: a 4-bit base is probed on one GPU "
                "(--peft lora shares a run across ranks)"
            )
        problems += self._task_problems()
        if self.lengths is not None:
            try:
                data_lengths.Lengths.from_text(self.lengths)
            except BadInput as exc:
                problems.append(str(exc).rstrip("."))
            if self.task in TASKS and self.task not in LENGTHS_TASKS:
                problems.append(
                    f"batches of the data's lengths are timed for {' and '.join(LENGTHS_TASKS)}, not {self.task}"
                )
        if self.sampling not in data_lengths.SAMPLINGS:
            problems.append(f"--sampling {self.sampling!r} is unknown; choose from {', '.join(data_lengths.SAMPLINGS)}")
        elif self.sampling != data_lengths.DEFAULT_SAMPLING and self.lengths is None:
            problems.append(
                f"--sampling {self.sampling} groups batches by the data's lengths: give --dataset (a causal "
                f"LM with --packing off)"
            )
        if not isinstance(self.padding_free, bool):
            problems.append(f"padding_free must be true or false (got {self.padding_free!r})")
        elif self.padding_free and (self.task != Task.CAUSAL_LM.value or self.lengths is None):
            problems.append(
                f"--padding-free on puts each micro-batch's examples end to end in one row: {PADDING_FREE_NEEDS}"
            )
        if self.task in TASKS:
            problems += recipes.trainer_problems(self.trainer, self.task)
        if self.task in TASKS:
            problems += evaluation.eval_problems(
                {name: getattr(self, name) for name in evaluation.EVAL_RECIPE}, self.task
            )
        if problems:
            raise BadInput("; ".join(problems) + ".")

    def _task_problems(self) -> list[str]:
        if self.task not in TASKS:
            return [f"--task {self.task!r} is unknown; choose from {', '.join(TASKS)}"]
        problems = []
        for name, flag, owner in (
            ("target_length", "--target-length", Task.SEQ2SEQ),
            ("num_labels", "--num-labels", Task.CLASSIFICATION),
        ):
            value = getattr(self, name)
            if self.task != owner:
                if value is not None:
                    problems.append(f"{flag} is for --task {owner}, not {self.task}; leave it out")
            elif not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT64_MAX:
                problems.append(f"{flag} must be a whole number of at least 1 for --task {owner} (got {value!r})")
        return problems

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step, over all ranks."""
        return self.micro_batch * self.grad_accum * self.ranks

    @property
    def ranks(self) -> int:
        """Processes (one GPU each) the run has in all: the world size."""
        return self.gpus * self.nodes

    @property
    def tokens_per_sequence(self) -> int:
        """Tokens one sequence puts through the model: a seq2seq pair counts source and target."""
        return self.block_size + (self.target_length or 0)

    @property
    def tokens_per_step(self) -> float:
        """Tokens trained on per optimizer step: with the data's lengths, its real (non-padding)
        tokens, expected (autotune.levers.lengths); else every position of every row."""
        if self.lengths is not None:
            return self.effective_batch * data_lengths.real_tokens_per_row(self.lengths, self.block_size)
        return self.effective_batch * self.tokens_per_sequence

    @property
    def padded_tokens_per_step(self) -> float:
        """Positions the model computes per optimizer step, padding included."""
        if self.padding_free:  # (no padding: the positions are the real tokens)
            return self.tokens_per_step
        if self.lengths is not None:
            return self.effective_batch * data_lengths.padded_row(
                self.lengths, self.micro_batch, self.rows_per_step, self.block_size, self.sampling
            )
        return self.effective_batch * self.tokens_per_sequence

    @property
    def padding_share(self) -> float | None:
        """The share of the computed tokens that are padding (None: no data lengths, none counted)."""
        if self.lengths is None:
            return None
        if self.padding_free:
            return 0.0
        return data_lengths.padding_share(
            self.lengths, self.micro_batch, self.block_size, rows_per_step=self.rows_per_step, sampling=self.sampling
        )

    @property
    def rows_per_step(self) -> int:
        """Examples each rank takes per optimizer step (a sampler's batch: transformers' LengthGroupedSampler's)."""
        return self.micro_batch * self.grad_accum

    @property
    def padded_per_real(self) -> float:
        """Positions computed per real token (1 without padding): a speed in real tokens/s times this
        is the speed of the model's work, which a larger micro-batch does not slow (the search's
        speed model and its structural bounds reason in it)."""
        return self.padded_tokens_per_step / self.tokens_per_step if self.lengths is not None else 1.0

    @property
    def timing_cycle(self) -> int | None:
        """Steps of the timed window's cycles (autotune.results.timing.window_seconds); None: steps of one shape."""
        return None if self.lengths is None else data_lengths.cycle_steps(self.rows_per_step)

    def to_dict(self) -> dict:
        return asdict(self)

    def key_fields(self) -> dict:
        """The fields that make the key: every field, less the later ones at their p1 meaning."""
        data = self.to_dict()
        for name, default in _LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def key(self) -> str:
        """Stable identity: version prefix plus a hash of the canonical JSON of every field."""
        return _config_key(self)

    def label(self) -> str:
        """Short human text, e.g. 'mb4x2 blk512 bf16 ckpt sdpa', 'mb4x2 blk512+128 bf16 ckpt sdpa'
        (seq2seq: source + target tokens). The task is the study's, so it is not repeated here."""
        ckpt = "ckpt" if self.checkpointing else "no-ckpt"
        block = f"{self.block_size}+{self.target_length}" if self.target_length is not None else str(self.block_size)
        label = f"mb{self.micro_batch}x{self.grad_accum} blk{block} {self.precision} {ckpt} {self.attention}"
        # FixedRecipe levers, when not the plain recipe's: 'mb4x2 blk512 bf16 ckpt sdpa adafactor w-bf16 lora-r8 trl'.
        if self.optimizer != recipes.DEFAULT_OPTIMIZER:
            label += f" {self.optimizer}"
        if self.weights != recipes.DEFAULT_WEIGHTS:
            label += f" w-{self.weights}"
        if self.peft is not None:
            label += f" {recipes.PeftSpec.from_text(self.peft).label()}"
        if self.trainer != recipes.DEFAULT_TRAINER:
            label += f" {self.trainer}"
        # Speed levers, when on: 'mb8x1 blk512 bf16 no-ckpt sdpa compiled expandable liger'.
        if self.compile:
            label += " compiled"
        if self.allocator != speed_levers.DEFAULT_ALLOCATOR:
            label += f" {self.allocator}"
        if self.liger:
            label += " liger"
        if self.sampling != data_lengths.DEFAULT_SAMPLING:
            label += " grouped"
        if self.padding_free:
            label += " padding-free"
        label += sharding.label(self.gpus, self.strategy, self.nodes)
        return label + evaluation.label(self)


@functools.lru_cache(maxsize=4096)
def _config_key(config: ProbeConfig) -> str:
    # Cached: the search asks for keys of the same few hundred configs many thousands of times.
    canonical = json.dumps(config.key_fields(), sort_keys=True, separators=(",", ":"))
    return f"{KEY_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:20]}"
