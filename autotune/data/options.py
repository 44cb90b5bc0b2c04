"""What the user typed about their data: `--dataset` and its column and tokenizer flags, checked
for emptiness (what each value means is read where the data is: text.py, task_data.py)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.vocabulary.errors import BadInput


@dataclass(frozen=True, slots=True)
class DataOptions:
    """Where the data is and which columns hold what (`--dataset` and its column flags), as search,
    plan and train are given them."""

    dataset: str
    text_column: str | None = None  # seq2seq: the source text
    target_column: str | None = None  # seq2seq only
    label_column: str | None = None  # classification only
    eval_split: str | None = None  # a split name, a file, or a share of the examples ('5%')
    tokenizer: str | None = None  # default: the model reference's own

    def __post_init__(self) -> None:
        for flag, text in (
            ("--dataset", self.dataset),
            ("--text-column", self.text_column),
            ("--target-column", self.target_column),
            ("--label-column", self.label_column),
            ("--eval-split", self.eval_split),
            ("--tokenizer", self.tokenizer),
        ):
            if text is not None and not text.strip():
                raise BadInput(f"{flag} is empty; give a value, or leave {flag} out.")
