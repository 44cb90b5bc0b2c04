"""Training tasks: what is trained on top of a model's body, which decides the model class built,
the shape of a training batch, and the Hugging Face example script a winner hands off to.

The task is a recipe lever: autotune never changes it, it reads it from the model's config.json
(`architectures`) or from `--task`. Reads JSON only: no torch or transformers import here, so that
telling a task costs nothing before a probe process starts. Whether transformers has a class for
the task is asked where the model is built (the probe child), since that import costs seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from autotune.vocabulary.errors import BadInput
from autotune.levers.evaluation import EVAL_RECIPE
from autotune.levers.lengths import Lengths
from autotune.levers.recipes import DEFAULT_TRAINER


class Task(StrEnum):
    CAUSAL_LM = "causal-lm"  # next-token prediction: GPT-2, Llama, Mistral...
    SEQ2SEQ = "seq2seq"  # encoder-decoder generation: T5, BART, Pegasus (summarization, translation)
    CLASSIFICATION = "classification"  # one label per sequence: BERT, RoBERTa, DistilBERT (GLUE-style)
    MASKED_LM = "masked-lm"  # masked-token prediction: BERT-style pre-training


TASKS = tuple(t.value for t in Task)
TASK_HELP = (
    "causal-lm, seq2seq, classification or masked-lm [default: from the config's architectures, "
    "e.g. *ForConditionalGeneration is seq2seq]"
)

# The transformers Auto class that builds each task's model (a name: transformers is imported by
# the probe child, not here).
AUTO_CLASSES = {
    Task.CAUSAL_LM: "AutoModelForCausalLM",
    Task.SEQ2SEQ: "AutoModelForSeq2SeqLM",
    Task.CLASSIFICATION: "AutoModelForSequenceClassification",
    Task.MASKED_LM: "AutoModelForMaskedLM",
}

# The Hugging Face example script each task's winner hands off to (transformers/examples/pytorch).
EXAMPLE_SCRIPTS = {
    Task.CAUSAL_LM: "run_clm.py",
    Task.SEQ2SEQ: "run_summarization.py",
    Task.CLASSIFICATION: "run_classification.py",
    Task.MASKED_LM: "run_mlm.py",
}

# The fixed recipe: the recipe levers a study holds fixed (what is trained: the task and its
# fields, the adapters, the trainer whose step the probes time, the data's lengths its batches are
# drawn from: autotune.levers.lengths), at what a causal-LM config has: the meaning of a config or a study stored
# before tasks existed, which has none of them; with them, how the run evaluates (autotune.levers.evaluation).
# (The levers a search may choose among, optimizer and weights, are autotune.levers.recipes'.)
FIXED_RECIPE = {
    "task": Task.CAUSAL_LM.value,
    "target_length": None,
    "num_labels": None,
    "peft": None,
    "trainer": DEFAULT_TRAINER,
    "lengths": None,
    **EVAL_RECIPE,
}

# run_summarization.py's default --max_target_length: the target length when the user fixes none.
DEFAULT_TARGET_LENGTH = 128
# The share of tokens masked in a masked-LM batch (BERT; DataCollatorForLanguageModeling's default).
MLM_PROBABILITY = 0.15

# Tasks whose examples are padded (each batch to its longest row, with an attention mask): those
# whose example scripts tokenise one example per row. Causal and masked LMs pack text into full
# blocks (run_clm.py, run_mlm.py's group_texts): no padding, no mask.
PADDED_TASKS = frozenset({Task.SEQ2SEQ, Task.CLASSIFICATION})


@dataclass(frozen=True, slots=True)
class DataShape:
    """The longest example of a data set, in tokens as the run's encoder makes them (special tokens
    included): the longest batch a run of it can form (autotune.data.shape measures it).

    A padded task (PADDED_TASKS) trains on batches no longer than its longest example: probing a
    block size above it measures memory and time the run never spends, and can call a config that
    fits too big. So the block sizes (and a seq2seq target length) are capped at it; truncation at
    the capped length cuts nothing the longer one kept, so what is trained does not change.
    `longest` None: a packed task, whose every block is full whatever the data."""

    dataset: str
    task: str
    examples: int
    longest: int | None = None  # source (classification: text) tokens
    longest_target: int | None = None  # seq2seq target tokens
    labels: int | None = None  # classification: the labels the data holds (the head's outputs)
    lengths: str | None = None  # the training examples' lengths (autotune.levers.lengths' text form)
    # The training split's tokens, one epoch (a seq2seq pair's source and target; None: not counted,
    # see data.shape.measure_data_shape's `count_tokens`): what `plan --dataset D --epochs E` times.
    tokens: int | None = None

    def block_sizes(self, asked: tuple[int, ...]) -> tuple[int, ...]:
        """`asked`, each capped at the longest example (the same once capped: one)."""
        if self.longest is None:
            return tuple(asked)
        return tuple(sorted({min(block, self.longest) for block in asked}))

    def target_length(self, asked: int | None) -> int | None:
        if asked is None or self.longest_target is None:
            return asked
        return min(asked, self.longest_target)

    def note(self, asked_blocks: tuple[int, ...], asked_target: int | None) -> str:
        """The line a search's header and a plan say: which shape was probed, from what."""
        if self.longest is None:
            return (
                f"--dataset {self.dataset}: {self.task} packs its text into full blocks, so every batch has the "
                f"block size whatever the data"
            )
        blocks, target = self.block_sizes(asked_blocks), self.target_length(asked_target)
        longest = f"{self.longest:,} tokens" + (
            f" + {self.longest_target:,} target tokens" if self.longest_target is not None else ""
        )
        probed = "/".join(str(b) for b in blocks) + (f"+{target}" if target is not None else "")
        changed = blocks != tuple(asked_blocks) or target != asked_target
        asked = "/".join(str(b) for b in asked_blocks) + (f"+{asked_target}" if asked_target is not None else "")
        how = (
            f"probing batches of {probed} tokens (not {asked}: no batch of this data is longer)"
            if changed
            else f"probing batches of {probed} tokens"
        )
        said = (
            f"--dataset {self.dataset}: the longest of its {self.examples:,} examples is {longest}; {how}, "
            f"padded with their attention mask as the run's collator pads them"
        )
        if self.lengths is not None and self.longest_target is None:
            said += (
                f"; timed on batches drawn from its lengths ({Lengths.from_text(self.lengths).describe(max(blocks))}), "
                f"each padded to its longest row: tokens/s counts real tokens, not padding"
            )
        return said


def assumed_batches_note(task: str, trainer: str, data_given: bool, packing: bool = True) -> str | None:
    """What a search or plan assumed of the run's batches where the data does not say (None: the
    probes' batches are the run's)."""
    if (Task(task) in PADDED_TASKS or not packing) and not data_given:
        what = f"every {task} batch" if packing else "every batch of examples trained one per row (--packing off)"
        return (
            f"no --dataset: {what} probed is the worst a run can form, each row as long as the block (padding "
            f"counted as tokens); give --dataset to time batches of your data's lengths"
        )
    if trainer == "trl" and packing:
        return (
            "--trainer trl: the probes time full blocks, as TRL trains with packing: true (what --format trl "
            "writes); TRL's default, packing: false, pads each example to its batch's longest: give --packing off "
            "with --dataset to time that"
        )
    return None


def padded_lengths(rows: int, longest: int) -> list[int]:
    """The tokens of each row of the batch a probe of a padded task measures: the worst batch of a
    run whose examples hold at most `longest` tokens, padded either to the batch's longest row
    (DataCollatorWithPadding, DataCollatorForSeq2Seq) or to `longest` (padding="max_length", as
    run_classification.py and autotune train pad). The batch has `longest` positions and carries
    padding in its last row, so that its mask cannot be dropped: transformers skips an all-ones
    mask where it can, and a mask with zeros costs memory (eager attention expands it and masks the
    softmax) and rules CUDA's flash kernel out. How much of the row is padding changes no memory:
    half. (A one-row batch padded to its own length carries none; the probe's is no smaller.)"""
    return [longest] * (rows - 1) + [max(1, longest // 2)]


# Class-name endings in `architectures`, most specific first.
_ARCHITECTURE_ENDINGS = (
    ("ForConditionalGeneration", Task.SEQ2SEQ),
    ("ForSequenceClassification", Task.CLASSIFICATION),
    ("ForMaskedLM", Task.MASKED_LM),
    ("ForCausalLM", Task.CAUSAL_LM),
    ("LMHeadModel", Task.CAUSAL_LM),
)


# Model types that are one task to everyone who writes a config of them without `architectures`
# (`GPT2Config(...).save_pretrained(dir)` writes none): decoder-only language models are trained as
# causal LMs, encoder-decoders as seq2seq. A type with classes of several tasks that people really
# train (BERT-like encoders: masked LM, classification, and a causal LM head too) is in neither,
# and is refused without --task (ENCODER_MODEL_TYPES says why).
CAUSAL_LM_MODEL_TYPES = frozenset(
    {
        "apertus",
        "arcee",
        "bamba",
        "biogpt",
        "bitnet",
        "bloom",
        "codegen",
        "cohere",
        "cohere2",
        "ctrl",
        "dbrx",
        "deepseek_v2",
        "deepseek_v3",
        "diffllama",
        "doge",
        "dots1",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone4",
        "falcon",
        "falcon_h1",
        "falcon_mamba",
        "gemma",
        "gemma2",
        "gemma3_text",
        "glm",
        "glm4",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gpt_neox_japanese",
        "gpt_oss",
        "gptj",
        "granite",
        "granitemoe",
        "granitemoehybrid",
        "granitemoeshared",
        "helium",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "jamba",
        "jetmoe",
        "lfm2",
        "llama",
        "llama4_text",
        "mamba",
        "mamba2",
        "minimax",
        "ministral",
        "mistral",
        "mixtral",
        "mpt",
        "nemotron",
        "olmo",
        "olmo2",
        "olmo3",
        "olmoe",
        "openai-gpt",
        "opt",
        "persimmon",
        "phi",
        "phi3",
        "phimoe",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "seed_oss",
        "smollm3",
        "stablelm",
        "starcoder2",
        "vaultgemma",
        "xglm",
        "zamba",
        "zamba2",
    }
)
SEQ2SEQ_MODEL_TYPES = frozenset(
    {
        "bart",
        "bigbird_pegasus",
        "blenderbot",
        "blenderbot-small",
        "fsmt",
        "led",
        "longt5",
        "m2m_100",
        "marian",
        "mbart",
        "mt5",
        "mvp",
        "nllb-moe",
        "pegasus",
        "pegasus_x",
        "plbart",
        "prophetnet",
        "switch_transformers",
        "t5",
        "t5gemma",
        "umt5",
    }
)
# Encoders trained as masked LMs and as classifiers alike (most also have a causal-LM head class):
# their config without architectures does not say which.
ENCODER_MODEL_TYPES = frozenset(
    {
        "albert",
        "bert",
        "big_bird",
        "camembert",
        "convbert",
        "data2vec-text",
        "deberta",
        "deberta-v2",
        "distilbert",
        "electra",
        "ernie",
        "flaubert",
        "funnel",
        "ibert",
        "longformer",
        "luke",
        "megatron-bert",
        "mobilebert",
        "modernbert",
        "mpnet",
        "nezha",
        "nystromformer",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "squeezebert",
        "xlm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xlnet",
        "xmod",
        "yoso",
    }
)


@dataclass(frozen=True, slots=True)
class TaskInference:
    """The task a config.json tells, and from what: `architectures`, `is_encoder_decoder`, or the model
    type (`assumed`: the config names no head, and its model type is one task to everyone); `task`
    None when it cannot be told, with `why` for the refusal."""

    task: Task | None
    source: str = ""  # "architectures", "is_encoder_decoder", "model type", or "" (not told)
    model_type: str = ""
    why: str = ""  # why it cannot be told (task None)

    @property
    def assumed(self) -> bool:
        """True when the task was assumed from the model type alone (no head named in the config)."""
        return self.source == "model type"

    def note(self) -> str | None:
        """One line for the search header or a probe's output where the task was assumed; None otherwise."""
        if not self.assumed or self.task is None:
            return None
        return (
            f"task {self.task} assumed from model type {self.model_type!r} (its config.json names no task head); "
            f"pass --task to train it as another"
        )


def tell_task(config: dict) -> TaskInference:
    """The task a config.json tells, and from what (TaskInference).

    An encoder-decoder config (`is_encoder_decoder`) is seq2seq whatever its architectures say: old T5
    configs name `T5WithLMHeadModel`, and bart-large's names the bare `BartModel`. Otherwise the
    architectures' class names tell it (`*ForCausalLM`, `*ForConditionalGeneration`, ...); where they
    name no head (none at all, as `GPT2Config(...).save_pretrained(dir)` writes, or only the bare
    `*Model`), the model type does for the types that are one task to everyone (CAUSAL_LM_MODEL_TYPES,
    SEQ2SEQ_MODEL_TYPES). Architectures naming two tasks, or another head, are not told.
    """
    model_type = str(config.get("model_type") or "")
    if config.get("is_encoder_decoder") is True:
        return TaskInference(Task.SEQ2SEQ, "is_encoder_decoder", model_type)
    named = config.get("architectures") or []
    architectures = [named] if isinstance(named, str) else [name for name in named if isinstance(name, str)]
    found = {task for name in architectures for ending, task in _ARCHITECTURE_ENDINGS if name.endswith(ending)}
    if len(found) == 1:
        return TaskInference(found.pop(), "architectures", model_type)
    if found:
        return TaskInference(None, "", model_type, f"its architectures name {len(found)} tasks")
    if any(not name.endswith("Model") for name in architectures):  # another head: a token classifier, a QA model...
        return TaskInference(None, "", model_type, "no task autotune trains")
    if model_type in CAUSAL_LM_MODEL_TYPES:
        return TaskInference(Task.CAUSAL_LM, "model type", model_type)
    if model_type in SEQ2SEQ_MODEL_TYPES:
        return TaskInference(Task.SEQ2SEQ, "model type", model_type)
    head = "no task head" if architectures else "no architectures"
    if model_type in ENCODER_MODEL_TYPES:
        return TaskInference(
            None, "", model_type, f"{head}, and a {model_type} model is trained as masked-lm or classification alike"
        )
    return TaskInference(None, "", model_type, f"{head}, and model type {model_type or '?'!r} does not tell one")


def infer_task(config: dict) -> Task | None:
    """The task a config.json tells (tell_task); None when it cannot be told."""
    return tell_task(config).task


def task_note(config: dict, requested: str | None = None) -> str | None:
    """The line to show (search header, probe and estimate output) when the task was assumed from the
    model type: None when --task was given or the config names its task."""
    return None if requested is not None else tell_task(config).note()


def resolve_task(config: dict, requested: str | None, reference: str) -> Task:
    """`requested` (checked), else the task the config tells; BadInput, with why, when neither tells."""
    if requested is not None:
        requested = requested.strip().lower()
        if requested not in TASKS:
            raise BadInput(f"--task {requested!r} is unknown; choose from {', '.join(TASKS)}.")
        return Task(requested)
    told = tell_task(config)
    if told.task is None:
        architectures = config.get("architectures") or []
        named = architectures if isinstance(architectures, str) else ", ".join(str(a) for a in architectures)
        detail = f"{named}: {told.why}" if named else told.why
        raise BadInput(
            f"--model {reference}: cannot tell its task from its config.json ({detail}); pass --task "
            f"({', '.join(TASKS)})."
        )
    return told.task


def stored_fixed_recipe(stored: dict) -> dict:
    """The fixed recipe of a stored space (a study's), the fields it lacks at FIXED_RECIPE."""
    return {name: stored[name] if stored.get(name) is not None else default for name, default in FIXED_RECIPE.items()}


def config_num_labels(config: dict) -> int:
    """The labels a config.json's classifier head has: `id2label`, else `num_labels`, else 2 (as
    transformers' PretrainedConfig defaults)."""
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    value = config.get("num_labels")
    return value if isinstance(value, int) and value > 0 else 2


def task_fields(
    config: dict,
    reference: str,
    *,
    task: str | None = None,
    target_length: int | None = None,
    num_labels: int | None = None,
    max_positions: int | None = None,
) -> dict:
    """The ProbeConfig fields of a task, checked: `task`, and `target_length` for seq2seq or
    `num_labels` for classification with their defaults. BadInput for a flag the task has no use
    for, or a target longer than the model's positions."""
    resolved = resolve_task(config, task, reference)
    if target_length is not None and resolved != Task.SEQ2SEQ:
        raise BadInput(f"--target-length is for --task seq2seq; {reference} is trained as {resolved}: leave it out.")
    if num_labels is not None and resolved != Task.CLASSIFICATION:
        raise BadInput(
            f"--num-labels is for --task classification; {reference} is trained as {resolved}: leave it out."
        )
    fields: dict = {"task": resolved.value}
    if resolved == Task.SEQ2SEQ:
        if target_length is None:
            target_length = min(DEFAULT_TARGET_LENGTH, max_positions or DEFAULT_TARGET_LENGTH)
        if target_length < 1:
            raise BadInput(f"--target-length must be at least 1 (got {target_length}).")
        if max_positions is not None and target_length > max_positions:
            raise BadInput(
                f"--target-length {target_length} is above {reference}'s maximum of {max_positions} "
                f"positions; use at most {max_positions}."
            )
        fields["target_length"] = target_length
    if resolved == Task.CLASSIFICATION:
        fields["num_labels"] = num_labels if num_labels is not None else config_num_labels(config)
        if fields["num_labels"] < 1:
            raise BadInput(f"--num-labels must be at least 1 (got {num_labels}).")
    return fields
