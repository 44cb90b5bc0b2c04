"""The training examples of each task, made as the Hugging Face example script of the task makes
them, in the shapes the probe measured (so that the run's peak honours the probe's):

    causal-lm       run_clm.py: text packed into blocks, labels = input ids (autotune.data)
    masked-lm       run_mlm.py: the same blocks without labels; DataCollatorForLanguageModeling
                    masks 15% of the tokens of each batch and makes the labels
    seq2seq         run_summarization.py: a source column padded/truncated to the block size and a
                    target column to the target length; pad tokens of the target become -100 (no
                    loss); the model shifts the labels into its decoder inputs
    classification  run_classification.py: a text column padded/truncated to the block size and a
                    label column: text labels become ids (sorted), whole numbers stay ids, other
                    numbers make a one-output regression head

A study timed on the data's lengths (`config.lengths`: autotune.levers.lengths) trains each example as a
row, truncated at the block size and padded by the collator to its batch's longest: a classifier
with DataCollatorWithPadding (run_classification.py --pad_to_max_length False), a causal LM per
example (TRL's packing=False) with DataCollatorForLanguageModeling(mlm=False), whose labels leave
the padding out of the loss.

Columns are checked (`load_task_data`) before anything is searched or recorded; the examples are
made (`prepare_examples`) once the winner's block size is known. transformers is imported only by
`task_collator`, at the start of a run. A run whose evaluation keeps its predictions computes the
task's metrics from them (`task_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune.data.text import DEFAULT_TEXT_COLUMN, Blocks, TextData, load_text, pack_blocks, text_column
from autotune.vocabulary.errors import BadInput, DatasetError
from autotune.levers.evaluation import generates
from autotune.levers.lengths import Lengths
from autotune.levers.tasks import MLM_PROBABILITY, DataShape, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autotune.levers.config import ProbeConfig
    from autotune.data.options import DataOptions

# Column names looked for when no --text-column/--target-column is given, in this order (those of
# run_summarization.py's known data sets: xsum, cnn_dailymail, samsum, ...).
SOURCE_COLUMNS = (DEFAULT_TEXT_COLUMN, "document", "article", "source", "dialogue", "input")
TARGET_COLUMNS = ("summary", "target", "highlights", "output")
CLASSIFICATION_TEXT_COLUMNS = (DEFAULT_TEXT_COLUMN, "sentence")
DEFAULT_LABEL_COLUMN = "label"
_SHOWN_LABELS = 5


@dataclass(frozen=True, slots=True)
class Labels:
    """The labels of a classification data set, as the model's head is built for them."""

    count: int  # the head's outputs
    names: tuple[str, ...] | None = None  # name of each id, when the labels have names
    ids: dict[Any, int] | None = None  # a label's value -> its id, when labels are text (or true/false)
    regression: bool = False  # numbers that are not whole: one output, float labels

    def id2label(self) -> dict[int, str] | None:
        return dict(enumerate(self.names)) if self.names is not None else None

    def describe(self) -> str:
        if self.regression:
            return "numeric labels (regression, one output)"
        if self.names is None:
            return f"{self.count} labels (ids 0-{self.count - 1})"
        shown = ", ".join(self.names[:_SHOWN_LABELS]) + (", ..." if len(self.names) > _SHOWN_LABELS else "")
        return f"{self.count} labels ({shown})"

    def encode(self, value: Any) -> int | float:
        if self.regression:
            return float(value)
        return self.ids[value] if self.ids is not None else int(value)


@dataclass(slots=True)
class TaskData:
    """A task's raw data, checked: its text (and target or label columns) and its labels."""

    task: Task
    text: TextData
    labels: Labels | None = None

    def describe(self) -> str:
        return self.text.describe() + (f", {self.labels.describe()}" if self.labels is not None else "")


@dataclass(slots=True)
class Examples:
    """Tokenised training (and evaluation) examples of fixed length, one per row of the data."""

    train: Any  # datasets.Dataset with input_ids, attention_mask and labels
    eval: Any | None
    shape: str  # what one example is, e.g. '64 source + 16 target tokens'

    def describe(self) -> str:
        evaluation = f", {len(self.eval):,} for evaluation" if self.eval is not None else ""
        return f"{len(self.train):,} training examples of {self.shape}{evaluation}"


def load_task_data(task: Task, options: DataOptions) -> TaskData:
    """Read `options.dataset` and check that it holds what `task` trains on; DatasetError naming
    the columns when it does not, BadInput for a column flag the task has no use for."""
    for flag, value, owner in (
        ("--target-column", options.target_column, Task.SEQ2SEQ),
        ("--label-column", options.label_column, Task.CLASSIFICATION),
    ):
        if value is not None and task != owner:
            raise BadInput(f"{flag} is for --task {owner}; this run trains {task}: leave it out.")
    spec = options.dataset
    if task == Task.SEQ2SEQ:

        def seq2seq_columns(dataset) -> dict[str, str]:
            target = text_column(
                dataset,
                options.target_column,
                spec,
                flag="--target-column",
                names=TARGET_COLUMNS,
                role="target",
                only=False,
            )
            source = text_column(
                dataset, options.text_column, spec, names=SOURCE_COLUMNS, role="source text", taken=(target,)
            )
            return {"text": source, "target": target}

        return TaskData(task, load_text(spec, eval_split=options.eval_split, columns=seq2seq_columns))
    if task == Task.CLASSIFICATION:

        def classification_columns(dataset) -> dict[str, str]:
            label = label_column(dataset, options.label_column, spec)
            return {
                "text": text_column(
                    dataset, options.text_column, spec, names=CLASSIFICATION_TEXT_COLUMNS, taken=(label,)
                ),
                "label": label,
            }

        text = load_text(spec, eval_split=options.eval_split, columns=classification_columns)
        return TaskData(task, text, read_labels(text))
    return TaskData(task, load_text(spec, column=options.text_column, eval_split=options.eval_split))


def label_column(dataset, requested: str | None, spec: str) -> str:
    """The column holding the labels: `requested`, else 'label'; DatasetError naming the columns."""
    columns = ", ".join(dataset.column_names) or "none"
    if requested is not None:
        if requested not in dataset.column_names:
            raise DatasetError(f"--label-column {requested!r}: {spec} has no such column (it has: {columns}).")
        return requested
    if DEFAULT_LABEL_COLUMN not in dataset.column_names:
        raise DatasetError(
            f"--dataset {spec}: no label column for classification (columns: {columns}); give a data set "
            f"with a {DEFAULT_LABEL_COLUMN!r} column, or name it with --label-column."
        )
    return DEFAULT_LABEL_COLUMN


def read_labels(text: TextData) -> Labels:
    """The labels of the training split, checked, and those of the evaluation split against them."""
    import datasets

    column, spec = text.others["label"], text.source.spec
    feature = text.train.features[column]
    values = text.train.unique(column)
    if any(value is None or (isinstance(value, float) and math.isnan(value)) for value in values):
        raise DatasetError(f"--dataset {spec}: some rows have no label in column {column!r}; give every row a label.")
    dtype = getattr(feature, "dtype", None)
    whole = isinstance(feature, datasets.ClassLabel) or (dtype is not None and dtype.startswith(("int", "uint")))
    if whole and min(values) < 0:  # -1 marks an unlabelled row in GLUE's test splits
        raise DatasetError(
            f"--dataset {spec}: label {min(values)} in column {column!r} is negative; labels are ids from 0 (or text)."
        )
    if isinstance(feature, datasets.ClassLabel):  # a hub data set's named labels, stored as ids
        labels = Labels(count=feature.num_classes, names=tuple(feature.names))
    elif whole:
        labels = Labels(count=max(values) + 1)
    elif dtype is not None and dtype.startswith("float"):
        labels = Labels(count=1, regression=True)
    elif dtype in ("string", "large_string", "bool"):
        ordered = sorted(values)
        labels = Labels(
            count=len(ordered), names=tuple(str(v) for v in ordered), ids={v: i for i, v in enumerate(ordered)}
        )
    else:
        raise DatasetError(
            f"--label-column {column!r}: that column of {spec} holds {dtype or type(feature).__name__}, "
            f"not labels; give a column of text labels or whole-number ids."
        )
    if not labels.regression and len(values) < 2:
        raise DatasetError(
            f"--dataset {spec}: every row has the label {values[0]!r}; a classifier needs at least two labels."
        )
    if text.eval is not None:
        unknown = [
            v
            for v in text.eval.unique(column)
            if v is None
            or (labels.ids is not None and v not in labels.ids)
            or (labels.ids is None and not labels.regression and not 0 <= v < labels.count)
        ]
        if unknown:
            raise DatasetError(
                f"--eval-split: label {unknown[0]!r} of column {column!r} is not among the training data's "
                f"labels; give evaluation data labelled as the training data."
            )
    return labels


def check_tokenizer(task: Task, tokenizer: PreTrainedTokenizerBase, reference: str) -> None:
    """The tokens a task needs: a mask token for masked-lm; a padding token for every task but
    causal-lm (sequences are padded to the block size). A tokenizer without a padding token pads
    with its end-of-text (or unknown) token, as run_classification.py does for GPT-2."""
    if task == Task.CAUSAL_LM:
        return
    if task == Task.MASKED_LM and tokenizer.mask_token is None:
        raise BadInput(
            f"the tokenizer of {reference} has no mask token, which --task masked-lm needs; pass --tokenizer "
            f"with a mask token (a BERT-style tokenizer)."
        )
    if tokenizer.pad_token is None:
        stand_in = tokenizer.eos_token or tokenizer.unk_token
        if stand_in is None:
            raise BadInput(
                f"the tokenizer of {reference} has no padding, end-of-text or unknown token to pad the "
                f"{task} examples to the block size with; pass --tokenizer with a padding token."
            )
        tokenizer.pad_token = stand_in


def prepare_examples(
    data: TaskData, tokenizer: PreTrainedTokenizerBase, config: ProbeConfig, *, seed: int = 42
) -> Blocks | Examples:
    """The training (and evaluation) examples of `config`'s shape; DatasetError when none remain."""
    text = data.text
    per_example = config.lengths is not None
    if data.task in (Task.CAUSAL_LM, Task.MASKED_LM) and not per_example:
        blocks = pack_blocks(text, tokenizer, config.block_size, seed=seed)
        if data.task == Task.CAUSAL_LM:
            return blocks
        # The collator masks each batch afresh and makes its labels.
        return replace(
            blocks,
            train=blocks.train.remove_columns("labels"),
            eval=blocks.eval.remove_columns("labels") if blocks.eval is not None else None,
        )
    if data.task == Task.SEQ2SEQ:
        assert config.target_length is not None  # a seq2seq config has one (ProbeConfig checks)
        encode = _seq2seq_encoder(
            tokenizer, text.column, text.others["target"], config.block_size, config.target_length
        )
        shape = f"{config.block_size} source + {config.target_length} target tokens"
    elif data.task == Task.CAUSAL_LM:
        encode = _example_encoder(tokenizer, text.column, config.block_size)
        shape = f"at most {config.block_size} tokens, padded to each batch's longest"
    else:
        assert data.labels is not None  # read by load_task_data
        encode = _classification_encoder(
            tokenizer, text.column, text.others["label"], data.labels, config.block_size, padded=not per_example
        )
        shape = (
            f"{config.block_size} tokens"
            if not per_example
            else f"at most {config.block_size} tokens, padded to each batch's longest"
        )
    train = _encode(text.train, encode, text.source.spec, "--dataset")
    evaluation = _encode(text.eval, encode, text.source.spec, "--eval-split") if text.eval is not None else None
    if text.eval_fraction:
        if len(train) < 2:
            raise DatasetError(
                f"--eval-split {text.eval_fraction:.0%}: only one example; give more data or no --eval-split."
            )
        parts = train.train_test_split(test_size=text.eval_fraction, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    return Examples(train=train, eval=evaluation, shape=shape)


def _encode(dataset, encode, spec: str, flag: str):
    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="Tokenizing")
    if len(encoded) == 0:
        raise DatasetError(f"{flag} {spec}: no row has text to train on; give rows with text in every column read.")
    return encoded


def _seq2seq_encoder(tokenizer, source: str, target: str, block_size: int, target_length: int):
    pad = tokenizer.pad_token_id

    def encode(batch: dict[str, list]) -> dict[str, list]:
        # As run_summarization.py: rows missing a source or a target are left out.
        keep = [i for i, (s, t) in enumerate(zip(batch[source], batch[target])) if s and t]
        if not keep:
            return {"input_ids": [], "attention_mask": [], "labels": []}
        inputs = tokenizer(
            [batch[source][i] for i in keep],
            max_length=block_size,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
        )
        targets = tokenizer(
            text_target=[batch[target][i] for i in keep],
            max_length=target_length,
            padding="max_length",
            truncation=True,
        )
        # Padding carries no loss (run_summarization.py's ignore_pad_token_for_loss); the model turns
        # -100 back into padding where it shifts the labels into decoder inputs.
        labels = [[t if t != pad else -100 for t in ids] for ids in targets["input_ids"]]
        return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels}

    return encode


def _example_encoder(tokenizer, column: str, block_size: int):
    """A causal LM's examples one per row, truncated at the block (the collator pads and labels them)."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(
            [t for t in batch[column] if t], max_length=block_size, truncation=True, return_attention_mask=True
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    return encode


def _classification_encoder(tokenizer, column: str, label: str, labels: Labels, block_size: int, padded: bool = True):
    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(
            [t or "" for t in batch[column]],
            max_length=block_size,
            padding="max_length" if padded else False,
            truncation=True,
            return_attention_mask=True,
        )
        return {
            "input_ids": encoded["input_ids"],
            "attention_mask": encoded["attention_mask"],
            "labels": [labels.encode(v) for v in batch[label]],
        }

    return encode


def example_lengths(data: TaskData, tokenizer: PreTrainedTokenizerBase, *, added: int = 0) -> DataShape:
    """The shape of a padded run's data (autotune.levers.tasks.DataShape): its longest example's tokens, as
    the encoders above make them before they truncate (special tokens included), over the training
    and evaluation rows: the longest batch the run can form, the one its probe must measure; and the
    training rows' lengths (autotune.levers.lengths), which the timed batches are drawn from. `added`:
    tokens the run's trainer appends to each example (TRL's SFTTrainer, an end-of-sequence token)."""
    text = data.text
    source, target = text.column, text.others.get("target")

    def lengths(batch: dict[str, list]) -> dict[str, list]:
        if target is None:
            encoded = tokenizer([t or "" for t in batch[source]], truncation=False)
            return {
                "source": [len(ids) + added for ids in encoded["input_ids"]],
                "target": [0] * len(encoded["input_ids"]),
            }
        keep = [i for i, (s, t) in enumerate(zip(batch[source], batch[target])) if s and t]  # as _seq2seq_encoder
        sources = tokenizer([batch[source][i] for i in keep], truncation=False)["input_ids"] if keep else []
        targets = tokenizer(text_target=[batch[target][i] for i in keep], truncation=False)["input_ids"] if keep else []
        return {"source": [len(ids) for ids in sources], "target": [len(ids) for ids in targets]}

    longest, longest_target, examples, trained, tokens = 0, 0, 0, None, 0
    for split in (text.train, text.eval):
        if split is None:
            continue
        measured = split.map(lengths, batched=True, remove_columns=split.column_names, desc="Measuring lengths")
        if len(measured):
            examples += len(measured)
            longest = max(longest, max(measured["source"]))
            longest_target = max(longest_target, max(measured["target"]))
            if split is text.train:
                trained = Lengths.of(measured["source"]).to_text()
                tokens = sum(measured["source"]) + sum(measured["target"])
    if examples == 0 or longest == 0:
        raise DatasetError(
            f"--dataset {text.source.spec}: no row has text to train on; give rows with text in every column read."
        )
    return DataShape(
        text.source.spec,
        data.task.value,
        examples,
        longest,
        longest_target if target is not None else None,
        data.labels.count if data.labels is not None else None,
        lengths=trained,
        tokens=tokens,
    )


def packed_tokens(data: TaskData, tokenizer: PreTrainedTokenizerBase, *, added: int = 0) -> int:
    """The tokens of a packed run's training text, one epoch: every row's, as the packing encoder
    concatenates them into blocks (`added`: tokens the trainer appends to each row)."""
    text = data.text
    column = text.column

    def lengths(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer([t or "" for t in batch[column]], truncation=False)
        return {"tokens": [len(ids) + added for ids in encoded["input_ids"]]}

    measured = text.train.map(lengths, batched=True, remove_columns=text.train.column_names, desc="Counting tokens")
    return sum(measured["tokens"])


def task_collator(task: str, tokenizer: PreTrainedTokenizerBase, per_example: bool = False, padding_free: bool = False):
    """What turns a list of examples into a batch: every example of every task has the same
    length, so the default collator stacks them; masked-lm masks each batch as it is made. Examples
    one per row (`per_example`: a study timed on the data's lengths) are padded to the batch's longest,
    or, `padding_free`, put end to end in one row (position ids restarting at each: the probe's
    autotune.probe.batches.flattened)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    if padding_free:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening()
    if per_example:
        if tokenizer.pad_token is None:  # (GPT-2's: pad with the end-of-text token, as TRL and run_classification do)
            tokenizer.pad_token = tokenizer.eos_token
        if task == Task.CAUSAL_LM:
            return DataCollatorForLanguageModeling(tokenizer, mlm=False)
        return DataCollatorWithPadding(tokenizer)
    if task == Task.MASKED_LM:
        return DataCollatorForLanguageModeling(tokenizer, mlm_probability=MLM_PROBABILITY)
    return default_data_collator


def task_metrics(config: ProbeConfig, tokenizer: PreTrainedTokenizerBase) -> Callable[[Any], dict[str, float]]:
    """Trainer's `compute_metrics` for a run that keeps what its evaluation predicts (logits kept, or
    generated tokens), as the task's example script computes them from what it kept: the accuracy
    of the most likely token (run_clm.py: the next one; run_mlm.py: the masked ones), of the label
    (run_classification.py; a one-output head's mean squared error), and the generated length
    (run_summarization.py's gen_len; ROUGE needs packages these runs do not). On the host, from
    numpy arrays: none of it is on the card."""
    import numpy as np

    task, generated = Task(config.task), generates(config)
    pad = tokenizer.pad_token_id

    def compute(prediction: Any) -> dict[str, float]:
        predictions, labels = prediction.predictions, prediction.label_ids
        if isinstance(predictions, (tuple, list)):  # the logits first, then the model's other outputs kept
            predictions = predictions[0]
        if generated:
            tokens = np.asarray(predictions)
            counted = (tokens != -100) & (tokens != pad) if pad is not None else tokens != -100
            return {"gen_len": float(counted.sum(axis=-1).mean())}
        if task == Task.CLASSIFICATION and predictions.shape[-1] == 1:
            return {"mse": float(((predictions[..., 0] - labels) ** 2).mean())}
        guesses = predictions.argmax(axis=-1)
        if task == Task.CAUSAL_LM:  # the logits at each position predict the next token
            guesses, labels = guesses[:, :-1], labels[:, 1:]
        scored = labels != -100
        return {"accuracy": float((guesses[scored] == labels[scored]).mean()) if scored.any() else 0.0}

    return compute
