"""How far the estimator's CUDA predictions are from published GPU measurements: the error that
`estimate` and `plan` state beside a prediction, and that the search's skip rule allows for.

The figures live in stated_error.json beside this file, written by `python -m benchmarks.published`
from its validation set (benchmarks/published/: memory figures measured on real cards and
published, each with its configuration and source) and committed with its table
(benchmarks/results/published-estimates.md). Per kind of figure (peak allocated, peak reserved,
what nvidia-smi shows) and per fine-tuning method (full, LoRA, QLoRA): how many measurements, the
median and the worst absolute error of the prediction.

A CPU prediction has no stated error: it equals what the CPU probe accounts to the byte (the
suite checks it). Torch-free: `estimate`, `plan` and the search read it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from autotune.levers.recipes import PeftSpec

FILE = Path(__file__).with_name("stated_error.json")
KINDS = ("allocated", "reserved", "nvidia-smi")
METHODS = ("full", "lora", "qlora")
ALL = "all"  # every method together: where a method has too few measurements of its own
# A method's own figures are stated only from this many measurements; fewer: every method's.
MIN_OF_A_METHOD = 3
KIND_TEXT = {
    "allocated": "peak allocated",
    "reserved": "peak reserved",
    "nvidia-smi": "memory on the card (nvidia-smi)",
}
METHOD_TEXT = {"full": "full fine-tunes", "lora": "LoRA fine-tunes", "qlora": "QLoRA fine-tunes", ALL: "fine-tunes"}


@dataclass(frozen=True, slots=True)
class StatedError:
    """The error of one kind of prediction: fractions of the measured figure."""

    kind: str
    method: str  # a METHODS name, or ALL
    count: int  # published measurements it was held to
    median: float  # median absolute error
    worst: float  # largest absolute error

    def text(self) -> str:
        return (
            f"±{self.median:.1%} median, {self.worst:.1%} at worst, against {self.count} published "
            f"measurements of {METHOD_TEXT.get(self.method, self.method)}' {KIND_TEXT.get(self.kind, self.kind)}"
        )


def load(path: Path = FILE) -> dict[tuple[str, str], StatedError]:
    """Every stated error, by (kind, method); empty where the file is missing (a source checkout
    before the validation set was first run). Read once per process."""
    return dict(_read(path))


@functools.cache
def _read(path: Path) -> dict[tuple[str, str], StatedError]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {
        (e["kind"], e["method"]): StatedError(
            e["kind"], e["method"], int(e["count"]), float(e["median"]), float(e["worst"])
        )
        for e in data.get("errors", [])
    }


def method_of(peft: str | None) -> str:
    """full, lora or qlora, from a config's stored --peft text (None: full fine-tuning)."""
    return "full" if peft is None else PeftSpec.from_text(peft).kind


def stated(kind: str, peft: str | None, errors: dict[tuple[str, str], StatedError] | None = None) -> StatedError | None:
    """The stated error of a CUDA prediction of `kind` for a config trained with `peft`: its method's
    where that has MIN_OF_A_METHOD measurements, else every method's (None: none published)."""
    errors = load() if errors is None else errors
    own = errors.get((kind, method_of(peft)))
    if own is not None and own.count >= MIN_OF_A_METHOD:
        return own
    return errors.get((kind, ALL))


def skip_margin(peft: str | None, errors: dict[tuple[str, str], StatedError] | None = None) -> float | None:
    """The share of the budget a CUDA prediction may be over it and still be probed: the worst
    error of the predicted peak allocated (what the skip rule compares, with the context) for the
    method, rounded up to a whole percent. None where nothing is published."""
    error = stated("allocated", peft, errors)
    return None if error is None else math.ceil(error.worst * 100 - 1e-9) / 100
