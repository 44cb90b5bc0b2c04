"""SearchSpace: the values a user allows for each lever, the fixed work per optimizer step, and the
candidate configurations they span. Gradient accumulation is derived, never searched: every
candidate does the same work per optimizer step, so their throughputs compare fairly."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from autotune.vocabulary import defaults
from autotune.levers import evaluation
from autotune.levers import recipes
from autotune.levers import sharding
from autotune.levers import speed_levers
from autotune.levers import lengths as data_lengths
from autotune.levers.config import ATTENTIONS, PADDING_FREE_NEEDS, PRECISIONS, ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.levers.evaluation import recipe_fields
from autotune.specs.models import ModelSpec
from autotune.levers.tasks import FIXED_RECIPE, DataShape, Task, assumed_batches_note
from autotune.vocabulary.units import INT64_MAX


@dataclass(frozen=True, slots=True)
class SearchSpace:
    model: str
    micro_batches: tuple[int, ...] = defaults.MICRO_BATCHES
    block_sizes: tuple[int, ...] = (defaults.BLOCK_SIZE,)
    precisions: tuple[str, ...] = defaults.PRECISIONS
    checkpointing: tuple[bool, ...] = defaults.CHECKPOINTING
    attentions: tuple[str, ...] = defaults.ATTENTIONS
    effective_batch: int | None = defaults.EFFECTIVE_BATCH  # sequences per optimizer step
    effective_tokens: int | None = None  # tokens per optimizer step (several block sizes)
    # FixedRecipe levers, fixed for a study (autotune.levers.tasks): what is trained, never searched.
    task: str = Task.CAUSAL_LM.value
    target_length: int | None = None  # seq2seq target tokens
    num_labels: int | None = None  # classification outputs
    peft: str | None = None  # LoRA/QLoRA (recipes.PeftSpec's text)
    trainer: str = recipes.DEFAULT_TRAINER  # whose step the probes time (recipes.TRAINERS)
    lengths: str | None = None  # the data's example lengths (autotune.levers.lengths)
    # How the run evaluates (autotune.levers.evaluation): every candidate's probe runs these phases too.
    eval_batch: int | None = None
    auto_eval_batch: bool = False
    eval_logits: str = evaluation.LOSS_ONLY
    eval_accumulation_steps: int | None = None
    generation_max_length: int | None = None
    generation_num_beams: int = 1
    # FixedRecipe levers the user allows the search to choose among (autotune.levers.recipes).
    optimizers: tuple[str, ...] = (recipes.DEFAULT_OPTIMIZER,)
    weights: tuple[str, ...] = (recipes.DEFAULT_WEIGHTS,)
    samplings: tuple[str, ...] = (
        data_lengths.DEFAULT_SAMPLING,
    )  # the run's sampler (autotune.levers.lengths.SAMPLINGS)
    padding_frees: tuple[bool, ...] = (
        False,
    )  # each micro-batch's examples end to end, unpadded (ProbeConfig.padding_free)
    # Speed levers the search chooses among (autotune.levers.speed_levers): they keep the math.
    compiles: tuple[bool, ...] = (False,)
    allocators: tuple[str, ...] = (speed_levers.DEFAULT_ALLOCATOR,)
    ligers: tuple[bool, ...] = (False,)
    # Ranks (one GPU each) and how they may share the run (autotune.levers.sharding): a free lever, searched.
    gpus: int = 1  # on each node
    strategies: tuple[str, ...] = ()  # () on one GPU
    nodes: int = 1
    # What building the space assumed, said with a search's header and a plan (the data's shape):
    # not part of what the space is, so neither stored nor compared.
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        problems = sharding.count_problems(self.gpus, self.nodes)
        if problems:
            pass
        elif self.ranks == 1 and self.strategies:
            problems.append("--strategies share a run across ranks: give --gpus 2 or more, or leave them out")
        elif self.ranks > 1 and not self.strategies:
            problems.append("--strategies needs at least one value")
        elif self.ranks > 1 and recipes.is_qlora(self.peft):
            problems.append(
                "--peft qlora with --gpus 2 or more is not supported: a 4-bit base is searched on one GPU "
                "(--peft lora shares a run across ranks)"
            )
        for value in self.strategies:
            if value not in sharding.STRATEGIES:
                problems.append(f"--strategies: {value!r} is unknown; choose from {', '.join(sharding.STRATEGIES)}")
        if not self.micro_batches or min(self.micro_batches) < 1:
            problems.append("--micro-batches needs values of at least 1")
        if not self.block_sizes or min(self.block_sizes) < 1:
            problems.append("--block-sizes needs values of at least 1")
        # The database stores 64-bit integers: larger values would fail at the first write.
        for list_flag, numbers in (("--micro-batches", self.micro_batches), ("--block-sizes", self.block_sizes)):
            if numbers and max(numbers) > INT64_MAX:
                problems.append(f"{list_flag}: {max(numbers)} is too large (at most {INT64_MAX})")
        for work_flag, work in (
            ("--effective-batch", self.effective_batch),
            ("--effective-tokens", self.effective_tokens),
        ):
            if work is not None and not 1 <= work <= INT64_MAX:
                problems.append(f"{work_flag} must be a whole number from 1 to {INT64_MAX} (got {work})")
        for value in self.precisions:
            if value not in PRECISIONS:
                problems.append(f"--precisions: {value!r} is unknown; choose from {', '.join(PRECISIONS)}")
        for value in self.attentions:
            if value not in ATTENTIONS:
                problems.append(f"--attention: {value!r} is unknown; choose from {', '.join(ATTENTIONS)}")
        for value in self.optimizers:
            if value not in recipes.OPTIMIZERS:
                problems.append(f"--optimizers: {value!r} is unknown; choose from {recipes.optimizer_names()}")
        for value in self.samplings:
            if value not in data_lengths.SAMPLINGS:
                problems.append(f"--sampling: {value!r} is unknown; choose from {', '.join(data_lengths.SAMPLINGS)}")
        if not self.samplings:
            problems.append("--sampling needs at least one value")
        elif set(self.samplings) != {data_lengths.DEFAULT_SAMPLING} and self.lengths is None:
            problems.append(
                "--sampling group_by_length groups batches by the data's lengths: give --dataset (a causal "
                "LM with --packing off)"
            )
        if not self.padding_frees:
            problems.append("--padding-free needs at least one value")
        elif True in self.padding_frees and (self.task != Task.CAUSAL_LM or self.lengths is None):
            problems.append(
                f"--padding-free on puts each micro-batch's examples end to end in one row: {PADDING_FREE_NEEDS}"
            )
        for value in self.weights:
            if value not in recipes.WEIGHTS:
                problems.append(f"--weights: {value!r} is unknown; choose from {', '.join(recipes.WEIGHTS)}")
        if not self.optimizers or not self.weights:
            problems.append("--optimizers and --weights need at least one value")
        for value in self.allocators:
            if value not in speed_levers.ALLOCATORS:
                problems.append(f"--allocators: {value!r} is unknown; choose from {', '.join(speed_levers.ALLOCATORS)}")
        if not self.compiles or not self.allocators or not self.ligers:
            problems.append("--compile, --allocators and --liger need at least one value")
        if "bf16" in self.weights and self.precisions and set(self.precisions) == {"fp16"}:
            problems.append("--weights bf16 trains in bf16: add bf16 or fp32 to --precisions")
        if (self.effective_batch is None) == (self.effective_tokens is None):
            problems.append("give exactly one of --effective-batch and --effective-tokens")
        if len(self.block_sizes) > 1 and self.effective_tokens is None:
            problems.append(
                "several --block-sizes need --effective-tokens, so that every candidate does the same work per optimizer step"
            )
        problems += evaluation.eval_problems(self.evaluation, self.task)
        problems += recipes.trainer_problems(self.trainer, self.task)
        if problems:
            raise BadInput("; ".join(problems) + ".")

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        *,
        micro_batches=None,
        block_sizes=None,
        precisions=None,
        checkpointing=None,
        attentions=None,
        effective_batch=None,
        effective_tokens=None,
        task=None,
        target_length=None,
        num_labels=None,
        optimizers=None,
        weights=None,
        peft=None,
        trainer=None,
        compiles=None,
        allocators=None,
        ligers=None,
        evaluation: dict | None = None,
        gpus: int = 1,
        strategies=None,
        nodes: int = 1,
        data_shape: DataShape | None = None,
        packing: bool | None = None,
        samplings=None,
        padding_frees=None,
    ) -> "SearchSpace":
        # `evaluation`: what the command line asked of the run's evaluation (evaluation.recipe_fields).
        """A space for `spec` with documented defaults for whatever is not given, checked against
        the model (block sizes within its maximum positions; the task from its architectures).
        `data_shape`: the user's data (autotune.levers.tasks.DataShape), whose longest example caps the block
        sizes and the target length of a padded task, and whose lengths the timed batches are drawn
        from (a classifier's; a causal LM's trained per example, `packing` False: autotune.levers.lengths)."""
        max_positions = spec.max_positions
        packing = packing is not False
        recipe = spec.task_fields(task=task, target_length=target_length, num_labels=num_labels)
        if block_sizes is None:
            block_sizes = (min(defaults.BLOCK_SIZE, max_positions or defaults.BLOCK_SIZE),)
        spec.check_block_sizes(*block_sizes, flag="--block-sizes")
        notes: tuple[str, ...] = ()
        # Generation runs to the target length asked (a recipe lever), whatever length the data caps
        # its batches at: a shorter generation would change what the evaluation does.
        asked_target = recipe.get("target_length")
        if not packing and recipe["task"] != Task.CAUSAL_LM:
            raise BadInput(
                f"--packing off is for --task causal-lm (each example padded, not packed into blocks); "
                f"{spec.reference} is trained as {recipe['task']}, whose examples are padded already: "
                f"leave it out."
            )
        if data_shape is not None:
            notes = (data_shape.note(tuple(sorted(set(block_sizes))), asked_target),)
            if data_shape.lengths is not None and (recipe["task"] == Task.CLASSIFICATION or not packing):
                recipe["lengths"] = data_shape.lengths
            capped = data_shape.block_sizes(tuple(block_sizes))
            if effective_tokens is not None and capped != tuple(sorted(set(block_sizes))):
                raise BadInput(
                    f"--effective-tokens {effective_tokens} was meant for blocks of "
                    f"{'/'.join(map(str, sorted(set(block_sizes))))} tokens, but no example of --dataset "
                    f"{data_shape.dataset} is longer than {data_shape.longest}: give --effective-batch "
                    f"(sequences per optimizer step) instead."
                )
            block_sizes = capped
            if (
                trainer == "trl"
                and padding_frees
                and True in padding_frees
                and data_shape.longest is not None
                and data_shape.longest > max(block_sizes)
            ):
                raise BadInput(
                    f"--padding-free on with --trainer trl: TRL does not cut examples under padding_free "
                    f"(its SFTTrainer then refuses max_length), and --dataset {data_shape.dataset} has "
                    f"examples of up to {data_shape.longest:,} tokens, above the block "
                    f"({max(block_sizes)}): cut them to the block first, or leave --padding-free off."
                )
            if asked_target is not None:
                recipe["target_length"] = data_shape.target_length(asked_target)
        if effective_batch is None and effective_tokens is None:
            if len(block_sizes) > 1:
                effective_tokens = defaults.EFFECTIVE_BATCH * max(block_sizes)
            else:
                effective_batch = defaults.EFFECTIVE_BATCH
        micro_batches = tuple(micro_batches) if micro_batches is not None else defaults.MICRO_BATCHES
        if effective_batch is not None and micro_batches == defaults.MICRO_BATCHES:
            # (each of the ranks takes a micro-batch: the effective batch is micro-batch x accumulation x ranks)
            per_rank = max(1, effective_batch // max(1, gpus * nodes))
            micro_batches = tuple(m for m in micro_batches if m <= per_rank) or (per_rank,)
        if strategies is None:
            strategies = sharding.STRATEGIES if gpus * nodes > 1 else ()
        assumed = assumed_batches_note(
            recipe["task"], trainer or recipes.DEFAULT_TRAINER, data_shape is not None, packing
        )
        if assumed is not None:
            notes += (assumed,)
        return cls(
            model=spec.recorded,
            micro_batches=tuple(sorted(set(micro_batches))),
            block_sizes=tuple(sorted(set(block_sizes))),
            precisions=tuple(precisions or defaults.PRECISIONS),
            checkpointing=tuple(checkpointing if checkpointing is not None else defaults.CHECKPOINTING),
            attentions=tuple(attentions or defaults.ATTENTIONS),
            effective_batch=effective_batch,
            effective_tokens=effective_tokens,
            optimizers=tuple(
                dict.fromkeys(recipes.canonical_optimizer(o) for o in optimizers or (recipes.DEFAULT_OPTIMIZER,))
            ),
            weights=tuple(dict.fromkeys(weights or (recipes.DEFAULT_WEIGHTS,))),
            samplings=tuple(dict.fromkeys(samplings or (data_lengths.DEFAULT_SAMPLING,))),
            padding_frees=tuple(dict.fromkeys(padding_frees or (False,))),
            peft=peft,
            trainer=trainer or recipes.DEFAULT_TRAINER,
            compiles=tuple(dict.fromkeys(compiles or (False,))),
            allocators=tuple(dict.fromkeys(allocators or (speed_levers.DEFAULT_ALLOCATOR,))),
            ligers=tuple(dict.fromkeys(ligers or (False,))),
            gpus=gpus,
            nodes=nodes,
            strategies=tuple(dict.fromkeys(strategies)),
            notes=notes,
            **recipe,
            **recipe_fields(evaluation, asked_target),
        )

    @classmethod
    def from_stored(cls, stored: dict) -> "SearchSpace":
        """The space a study stored (`to_dict`, its lists read back from JSON)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items()}
        return cls(**fields)

    def grad_accum(self, micro_batch: int, block_size: int) -> int | None:
        """Accumulation that keeps the work per optimizer step fixed (every rank taking a micro-batch
        per micro-step); None when it cannot."""
        if self.effective_tokens is not None:
            per_micro = micro_batch * block_size * self.ranks
            return self.effective_tokens // per_micro if self.effective_tokens % per_micro == 0 else None
        assert self.effective_batch is not None
        per_micro = micro_batch * self.ranks
        return self.effective_batch // per_micro if self.effective_batch % per_micro == 0 else None

    def candidates(self) -> list[ProbeConfig]:
        """Every configuration of the space that keeps the effective batch exact."""
        out = []
        for optimizer, weights, compiled, allocator, liger, strategy, sampling, padding_free in itertools.product(
            self.optimizers,
            self.weights,
            self.compiles,
            self.allocators,
            self.ligers,
            self.strategies or (None,),
            self.samplings,
            self.padding_frees,
        ):
            if padding_free and sampling != data_lengths.DEFAULT_SAMPLING:
                continue  # rows without padding gain nothing from being grouped by length: only the order changes
            for precision in self.precisions:
                if weights == "bf16" and precision == "fp16":
                    continue  # pure bf16 does not train in fp16
                for checkpointing, attention, block, micro in itertools.product(
                    self.checkpointing, self.attentions, self.block_sizes, self.micro_batches
                ):
                    accum = self.grad_accum(micro, block)
                    if accum is None:
                        continue
                    out.append(
                        ProbeConfig(
                            model=self.model,
                            micro_batch=micro,
                            block_size=block,
                            grad_accum=accum,
                            precision=precision,
                            checkpointing=checkpointing,
                            attention=attention,
                            optimizer=optimizer,
                            weights=weights,
                            task=self.task,
                            target_length=self.target_length,
                            num_labels=self.num_labels,
                            peft=self.peft,
                            trainer=self.trainer,
                            lengths=self.lengths,
                            sampling=sampling,
                            padding_free=padding_free,
                            compile=compiled,
                            allocator=allocator,
                            liger=liger,
                            gpus=self.gpus,
                            strategy=strategy,
                            nodes=self.nodes,
                            **self.evaluation,
                        )
                    )
        if not out:
            work = f"{self.effective_batch} sequences" if self.effective_batch else f"{self.effective_tokens} tokens"
            ranks = f" x {self.ranks} ranks" if self.ranks > 1 else ""
            raise BadInput(
                f"no micro-batch in --micro-batches{ranks} divides the effective batch ({work}) exactly; "
                f"use micro-batches that divide it, or change --effective-batch/--effective-tokens."
            )
        return out

    def dropped_micro_batches(self) -> list[int]:
        """Micro-batches the user asked for that no block size can use with an exact accumulation."""
        return [m for m in self.micro_batches if all(self.grad_accum(m, b) is None for b in self.block_sizes)]

    def to_dict(self) -> dict:
        """As stored with a study. The recipe levers appear when not causal-lm's, so that a causal-LM
        study stored before tasks existed still matches its space (and answers from the database)."""
        data = {
            "model": self.model,
            "micro_batches": list(self.micro_batches),
            "block_sizes": list(self.block_sizes),
            "precisions": list(self.precisions),
            "checkpointing": list(self.checkpointing),
            "attentions": list(self.attentions),
            "effective_batch": self.effective_batch,
            "effective_tokens": self.effective_tokens,
        }
        if self.task != Task.CAUSAL_LM or self.peft is not None:
            data.update(
                {
                    k: v
                    for k, v in self.fixed_recipe.items()
                    if k not in evaluation.EVAL_RECIPE
                    and k not in ("trainer", "lengths")
                    and (k != "peft" or v is not None)
                }
            )
        if self.trainer != recipes.DEFAULT_TRAINER:
            data["trainer"] = self.trainer
        if self.lengths is not None:
            data["lengths"] = self.lengths
        data.update({k: v for k, v in self.evaluation.items() if v != evaluation.EVAL_RECIPE[k]})
        if self.optimizers != (recipes.DEFAULT_OPTIMIZER,):
            data["optimizers"] = list(self.optimizers)
        if self.weights != (recipes.DEFAULT_WEIGHTS,):
            data["weights"] = list(self.weights)
        if self.samplings != (data_lengths.DEFAULT_SAMPLING,):
            data["samplings"] = list(self.samplings)
        if self.padding_frees != (False,):
            data["padding_frees"] = list(self.padding_frees)
        for name, plain in (
            ("compiles", (False,)),
            ("allocators", (speed_levers.DEFAULT_ALLOCATOR,)),
            ("ligers", (False,)),
        ):
            if getattr(self, name) != plain:
                data[name] = list(getattr(self, name))
        if self.ranks > 1:
            data.update(gpus=self.gpus, strategies=list(self.strategies))
        if self.nodes > 1:
            data.update(nodes=self.nodes)
        return data

    @property
    def ranks(self) -> int:
        """Processes (one GPU each) each candidate runs on, in all."""
        return self.gpus * self.nodes

    @property
    def fixed_recipe(self) -> dict:
        """What is trained: the task and its fields (compare with tasks.stored_fixed_recipe of a study)."""
        return {name: getattr(self, name) for name in FIXED_RECIPE}

    @property
    def evaluation(self) -> dict:
        """How the run evaluates: the fields of autotune.levers.evaluation.EVAL_RECIPE."""
        return {name: getattr(self, name) for name in evaluation.EVAL_RECIPE}

    @property
    def work_per_step(self) -> int:
        """What the store records as the study's effective batch: sequences, or tokens when several block sizes."""
        return self.effective_batch if self.effective_batch is not None else int(self.effective_tokens or 0)


def group_key(config: ProbeConfig) -> tuple:
    """Configurations whose memory need grows with the micro-batch: same precision, checkpointing,
    attention and block size, and either all accumulating gradients or not at all.

    A config that accumulates keeps every gradient alive through the next micro-step's forward and
    backward, so it needs about one set of gradients more than the same work done in a single
    micro-step (gpt2: +475 MiB). The micro-batch that equals the effective batch (no accumulation)
    can therefore fit where a smaller, accumulating one does not: it gets a group of its own.
    """
    return (
        config.precision,
        config.checkpointing,
        config.attention,
        config.block_size,
        config.grad_accum > 1,
        config.optimizer,
        config.weights,
        config.compile,
        config.allocator,
        config.liger,
        config.strategy,
        config.sampling,
        config.padding_free,
    )


def micro_batch_family(config: ProbeConfig) -> tuple:
    """Configurations that differ only in how the effective batch is split (micro-batch and
    accumulation): the same work per optimizer step, the same math. Within a family a larger
    micro-batch is not slower per token (fewer, fuller micro-steps): the search's speed model
    caps a smaller one's prediction by a larger one measured, and the confirmation round measures
    again a larger one measured slower (a window a neighbour slowed)."""
    fields = dataclasses.asdict(config)
    del fields["micro_batch"], fields["grad_accum"]
    return tuple(sorted(fields.items()))


def dominates_in_memory(small: ProbeConfig, large: ProbeConfig) -> bool:
    """True when `large` needs at least the memory of `small`: same precision, checkpointing,
    attention, optimizer and weights, a micro-batch and block size each at least as large, and not the one of the two
    that escapes accumulation's extra set of gradients (see group_key). Configs that differ in a
    speed lever are never compared: compile, the allocator and Liger change the memory need, but
    not in a direction known for every model, so each of their values is searched as its own group."""
    if small.grad_accum > 1 and large.grad_accum == 1:
        return False
    same = (
        "precision",
        "checkpointing",
        "attention",
        "optimizer",
        "weights",
        "compile",
        "allocator",
        "liger",
        "gpus",
        "strategy",
        "nodes",
    )
    return (
        all(getattr(small, name) == getattr(large, name) for name in same)
        and large.micro_batch >= small.micro_batch
        and large.block_size >= small.block_size
    )


def single_config(
    spec: ModelSpec,
    *,
    micro_batch: int,
    block_size: int,
    grad_accum: int = 1,
    precision: str = defaults.PRECISION,
    checkpointing: bool = False,
    attention: str = defaults.ATTENTION,
    task: str | None = None,
    target_length: int | None = None,
    num_labels: int | None = None,
    optimizer: str = recipes.DEFAULT_OPTIMIZER,
    weights: str = recipes.DEFAULT_WEIGHTS,
    peft: str | None = None,
    trainer: str = recipes.DEFAULT_TRAINER,
    compile: bool = False,
    allocator: str = speed_levers.DEFAULT_ALLOCATOR,
    liger: bool = False,
    evaluation: dict | None = None,
    gpus: int = 1,
    strategy: str | None = None,
    nodes: int = 1,
) -> ProbeConfig:
    """One configuration of `spec`, as `autotune probe` and `autotune estimate` are given it: the
    task told from the model's architectures when not given, with its defaults."""
    recipe = spec.task_fields(task=task, target_length=target_length, num_labels=num_labels)
    return ProbeConfig(
        model=spec.recorded,
        micro_batch=micro_batch,
        block_size=block_size,
        grad_accum=grad_accum,
        precision=precision,
        checkpointing=checkpointing,
        attention=attention,
        optimizer=optimizer,
        weights=weights,
        peft=peft,
        trainer=trainer,
        compile=compile,
        allocator=allocator,
        liger=liger,
        gpus=gpus,
        strategy=strategy,
        nodes=nodes,
        **recipe,
        **recipe_fields(evaluation, recipe.get("target_length")),
    )


def _precision_order(device_type: str) -> dict[str, int]:
    # Tensor cores make half precision fastest on GPUs; CPUs without AMX are often faster in fp32.
    order = ("bf16", "fp16", "tf32", "fp32") if device_type == "cuda" else ("fp32", "bf16", "fp16", "tf32")
    return {p: i for i, p in enumerate(order)}


def group_priority(config: ProbeConfig, device_type: str) -> tuple:
    """The order in which the search visits groups (and the estimator traces them): without
    checkpointing first (their results rule checkpointed configs out), likely-fast precisions and
    SDPA first, larger blocks first, the micro-batch that does not accumulate before those that do."""
    return (
        config.checkpointing,
        _precision_order(device_type).get(config.precision, 9),
        config.attention != "sdpa",
        -config.block_size,
        config.grad_accum > 1,
        config.optimizer,
        config.weights,
        config.compile,
        config.allocator != speed_levers.DEFAULT_ALLOCATOR,
        config.liger,
        _STRATEGY_ORDER.get(config.strategy or "", 0),
    )


# Likely fastest first: DDP moves the fewest bytes, keeping parameters gathered saves an all-gather,
# offload steps the optimizer on the host.
_STRATEGY_ORDER = {name: i for i, name in enumerate(("ddp", "fsdp-grad-op", "fsdp", "fsdp-offload"))}
