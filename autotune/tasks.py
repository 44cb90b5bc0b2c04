"""Training tasks: what is trained on top of a model's body, which decides the model class built,
the shape of a training batch, and the Hugging Face example script a winner hands off to.

The task is a recipe lever: autotune never changes it, it reads it from the model's config.json
(`architectures`) or from `--task`. Reads JSON only: no torch or transformers import here, so that
telling a task costs nothing before a probe process starts. Whether transformers has a class for
the task is asked where the model is built (the probe child), since that import costs seconds.
"""

from __future__ import annotations

from enum import StrEnum

from autotune.errors import BadInput


class Task(StrEnum):
    CAUSAL_LM = "causal-lm"            # next-token prediction: GPT-2, Llama, Mistral...
    SEQ2SEQ = "seq2seq"                # encoder-decoder generation: T5, BART, Pegasus (summarization, translation)
    CLASSIFICATION = "classification"  # one label per sequence: BERT, RoBERTa, DistilBERT (GLUE-style)
    MASKED_LM = "masked-lm"            # masked-token prediction: BERT-style pre-training


TASKS = tuple(t.value for t in Task)
TASK_HELP = ("causal-lm, seq2seq, classification or masked-lm [default: from the config's architectures, "
             "e.g. *ForConditionalGeneration is seq2seq]")

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
# fields, the adapters), at what a causal-LM config has: the meaning of a config or a study stored
# before tasks existed, which has none of them. (The levers a search may choose among, optimizer
# and weights, are autotune.recipes'.)
FIXED_RECIPE = {"task": Task.CAUSAL_LM.value, "target_length": None, "num_labels": None, "peft": None}

# run_summarization.py's default --max_target_length: the target length when the user fixes none.
DEFAULT_TARGET_LENGTH = 128
# The share of tokens masked in a masked-LM batch (BERT; DataCollatorForLanguageModeling's default).
MLM_PROBABILITY = 0.15

# Class-name endings in `architectures`, most specific first.
_ARCHITECTURE_ENDINGS = (
    ("ForConditionalGeneration", Task.SEQ2SEQ),
    ("ForSequenceClassification", Task.CLASSIFICATION),
    ("ForMaskedLM", Task.MASKED_LM),
    ("ForCausalLM", Task.CAUSAL_LM),
    ("LMHeadModel", Task.CAUSAL_LM),
)


def infer_task(config: dict) -> Task | None:
    """The task a config.json names through its `architectures`; None when it cannot be told.

    An encoder-decoder config (`is_encoder_decoder`) is seq2seq whatever its architectures say:
    old T5 configs name `T5WithLMHeadModel`, and bart-large's names the bare `BartModel`.
    """
    if config.get("is_encoder_decoder") is True:
        return Task.SEQ2SEQ
    architectures = config.get("architectures") or []
    found = {task for name in architectures if isinstance(name, str)
             for ending, task in _ARCHITECTURE_ENDINGS if name.endswith(ending)}
    return found.pop() if len(found) == 1 else None


def resolve_task(config: dict, requested: str | None, reference: str) -> Task:
    """`requested` (checked), else the task the config names; BadInput when neither tells."""
    if requested is not None:
        requested = requested.strip().lower()
        if requested not in TASKS:
            raise BadInput(f"--task {requested!r} is unknown; choose from {', '.join(TASKS)}.")
        return Task(requested)
    task = infer_task(config)
    if task is None:
        named = ", ".join(str(a) for a in config.get("architectures") or []) or "no architectures"
        raise BadInput(f"--model {reference}: cannot tell its task from its config.json ({named}); pass --task "
                       f"({', '.join(TASKS)}).")
    return task


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


def task_fields(config: dict, reference: str, *, task: str | None = None, target_length: int | None = None,
                num_labels: int | None = None, max_positions: int | None = None) -> dict:
    """The ProbeConfig fields of a task, checked: `task`, and `target_length` for seq2seq or
    `num_labels` for classification with their defaults. BadInput for a flag the task has no use
    for, or a target longer than the model's positions."""
    resolved = resolve_task(config, task, reference)
    if target_length is not None and resolved != Task.SEQ2SEQ:
        raise BadInput(f"--target-length is for --task seq2seq; {reference} is trained as {resolved}: leave it out.")
    if num_labels is not None and resolved != Task.CLASSIFICATION:
        raise BadInput(f"--num-labels is for --task classification; {reference} is trained as {resolved}: leave it out.")
    fields: dict = {"task": resolved.value}
    if resolved == Task.SEQ2SEQ:
        if target_length is None:
            target_length = min(DEFAULT_TARGET_LENGTH, max_positions or DEFAULT_TARGET_LENGTH)
        if target_length < 1:
            raise BadInput(f"--target-length must be at least 1 (got {target_length}).")
        if max_positions is not None and target_length > max_positions:
            raise BadInput(f"--target-length {target_length} is above {reference}'s maximum of {max_positions} "
                           f"positions; use at most {max_positions}.")
        fields["target_length"] = target_length
    if resolved == Task.CLASSIFICATION:
        fields["num_labels"] = num_labels if num_labels is not None else config_num_labels(config)
        if fields["num_labels"] < 1:
            raise BadInput(f"--num-labels must be at least 1 (got {num_labels}).")
    return fields
