"""What `autotune train` is asked (`TrainOptions`) and what it answers (`TrainOutcome`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotune.data.options import DataOptions
from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.status import RunEnd
from autotune.vocabulary.units import INT64_MAX
from autotune.train.summary import RunSummary


# The most passes over the data --epochs takes: far beyond any fine-tune, well within Trainer's step count.
MAX_EPOCHS = 1_000_000


@dataclass(frozen=True, slots=True)
class TrainOptions:
    """How to train, as opposed to what (the study's winner)."""

    dataset: str
    output_dir: str | None = None  # default: ./autotune-runs/<study>
    max_steps: int | None = None  # optimizer steps in all (a resumed run counts earlier ones)
    epochs: float | None = None  # default: 1 epoch when max_steps is not given
    device: str | None = None  # default: the device type the study measured on
    text_column: str | None = None  # seq2seq: the source text
    target_column: str | None = None  # seq2seq only
    label_column: str | None = None  # classification only
    eval_split: str | None = None  # a split name, a file, or a share of the blocks ('5%')
    resume: bool = False
    tokenizer: str | None = None  # default: the model reference's own
    learning_rate: float = 5e-5
    save_steps: int = 500
    logging_steps: int | None = None  # default: a tenth of max_steps, at most 50
    random_init: bool = False  # ignore weights the model reference has
    trust_remote_code: bool = False
    seed: int = 42
    merge: bool = False  # LoRA: also save the base with the adapters merged, in <output_dir>/merged

    @property
    def data(self) -> DataOptions:
        """Where the data is and what its columns hold, as search and plan take them too."""
        return DataOptions(
            self.dataset, self.text_column, self.target_column, self.label_column, self.eval_split, self.tokenizer
        )

    def __post_init__(self) -> None:
        problems = []
        # A flag given an empty value (`--output-dir "$OUT"` with OUT unset) must not mean its default.
        for flag, text in (
            ("--dataset", self.dataset),
            ("--output-dir", self.output_dir),
            ("--device", self.device),
            ("--text-column", self.text_column),
            ("--target-column", self.target_column),
            ("--label-column", self.label_column),
            ("--eval-split", self.eval_split),
            ("--tokenizer", self.tokenizer),
        ):
            if text is not None and not text.strip():
                problems.append(f"{flag} is empty; give a value, or leave {flag} out")
        if self.max_steps is not None and self.epochs is not None:
            problems.append("--max-steps and --epochs both given; choose one")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"--max-steps must be at least 1 (got {self.max_steps})")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            problems.append(f"--epochs must be positive (got {self.epochs})")
        elif self.epochs is not None and self.epochs > MAX_EPOCHS:  # (Trainer's step count overflows long before 1e308)
            problems.append(
                f"--epochs {self.epochs:g} is too many (at most {MAX_EPOCHS:,}); give fewer, or --max-steps"
            )
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            problems.append(f"--learning-rate must be positive (got {self.learning_rate})")
        if self.save_steps < 1:
            problems.append(f"--save-steps must be at least 1 (got {self.save_steps})")
        if self.logging_steps is not None and self.logging_steps < 1:
            problems.append(f"--logging-steps must be at least 1 (got {self.logging_steps})")
        for flag, value in (
            ("--max-steps", self.max_steps),
            ("--save-steps", self.save_steps),
            ("--logging-steps", self.logging_steps),
        ):
            if value is not None and value > INT64_MAX:  # stored, and handed to torch, as 64-bit integers
                problems.append(f"{flag} {value} is too large (at most {INT64_MAX})")
        if problems:
            raise BadInput("; ".join(problems) + ".")


@dataclass(slots=True)
class TrainOutcome:
    """What a run did (finished or oom); the summary is what autotune-run.json holds."""

    status: RunEnd
    run_id: int
    study: str
    output_dir: str
    summary: RunSummary
    message: str | None = None  # why the run stopped, when it did not finish
    warnings: list[str] = field(default_factory=list)
    searched: bool = False  # a search ran first to choose the configuration

    @property
    def finished(self) -> bool:
        return self.status == RunEnd.FINISHED
