"""The shape of the user's data (`--dataset` of search and plan): its longest example, measured as
the run's encoder makes it, so that the longest batch the run can form is what is probed
(autotune.levers.tasks.DataShape says how it caps the space).

Torch-free: `measure_data_shape` imports transformers and datasets only when it runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autotune.data.options import DataOptions
from autotune.levers.recipes import DEFAULT_TRAINER
from autotune.levers.tasks import PADDED_TASKS, DataShape, Task

if TYPE_CHECKING:
    from autotune.specs.models import ModelSpec


def measure_data_shape(
    spec: ModelSpec,
    task: str,
    data: DataOptions,
    trust_remote_code: bool = False,
    *,
    packing: bool = True,
    trainer: str = DEFAULT_TRAINER,
    count_tokens: bool = False,
) -> DataShape:
    """The shape of `data` for `task`, tokenised by `data.tokenizer` (else the model's own): the data
    and the tokenizer checked as train checks them (DatasetError, BadInput, ModelNotFound). A causal
    LM trained per example (`packing` False) is measured as a padded task is; TRL's SFTTrainer
    appends an end-of-sequence token to each text, which its lengths count. A packed task's shape
    needs no tokenizer, unless `count_tokens` asks for its tokens (the run's size: plan --epochs)."""
    from autotune.data.task_data import check_tokenizer, example_lengths, load_task_data, packed_tokens
    from autotune.data.tokenizer import load_tokenizer

    loaded = load_task_data(Task(task), data)
    added = 1 if trainer == "trl" and Task(task) == Task.CAUSAL_LM else 0
    packed = Task(task) not in PADDED_TASKS and packing
    if packed and not count_tokens:
        return DataShape(data.dataset, task, len(loaded.text.train))
    tokenizer = load_tokenizer(spec, data.tokenizer, trust_remote_code)
    check_tokenizer(Task(task), tokenizer, data.tokenizer or spec.reference)
    if packed:
        shape = DataShape(data.dataset, task, len(loaded.text.train))
        return dataclasses.replace(shape, tokens=packed_tokens(loaded, tokenizer, added=added))
    return example_lengths(loaded, tokenizer, added=added)


def shaped_space_args(
    spec: ModelSpec, space_args: dict, trust_remote_code: bool = False, *, count_tokens: bool = False
) -> dict:
    """SearchSpace.build's arguments with the `data` a user gave (DataOptions) measured into its
    `data_shape` (with its tokens where `count_tokens`), and a classifier's labels taken from it
    where --num-labels was not given (as train measures a new study's classifier)."""
    data = space_args.get("data")
    args = {name: value for name, value in space_args.items() if name != "data"}
    if data is None:
        return args
    task = spec.task_fields(
        task=args.get("task"), target_length=args.get("target_length"), num_labels=args.get("num_labels")
    )["task"]
    shape = measure_data_shape(
        spec,
        task,
        data,
        trust_remote_code,
        packing=args.get("packing") is not False,
        trainer=args.get("trainer") or DEFAULT_TRAINER,
        count_tokens=count_tokens,
    )
    if shape.labels is not None and args.get("num_labels") is None:
        args["num_labels"] = shape.labels
    return {**args, "data_shape": shape}
