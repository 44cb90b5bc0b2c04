"""The lengths of the user's examples, and what they make of a padded run's batches.

A run that pads each batch to its longest example (DataCollatorWithPadding, DataCollatorForSeq2Seq,
TRL's SFTTrainer with `packing=False`, axolotl with `sample_packing: false`, LLaMA-Factory's
default) spends time on every padding token and trains on none: the larger the micro-batch, the
longer its longest row is likely to be, and the more of each batch is padding. On long-tailed data
a larger micro-batch can so be slower in real tokens per second (ms-swift's benchmark on one A100:
micro-batch 1, 2, 4, 8 gave 4.31, 3.60, 3.02, 2.77 samples/s). The probe of such a run times
batches drawn from the data's lengths (`timing_rows`), and a config's throughput counts its real
(non-padding) tokens (`real_tokens_per_row`); its memory is still the worst batch's.

A data set's lengths travel as `Lengths`: QUANTILES evenly spaced quantiles of its examples' token
counts (special tokens included, before truncation), a few hundred characters in a config's key
and in every stored probe, whatever the data set's size. The expectations below are exact for a
run that draws its examples uniformly from those quantiles, which a data set of many examples is
to within the quantiles' spacing.

No torch: the search, the planner and the leaderboard read these numbers without it.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.vocabulary.errors import BadInput

QUANTILES = 64  # points kept of a data set's lengths: the (i + 0.5)/64 quantiles
PREFIX = "q"  # the text form's first letter, so that a later form can be told apart
SHUFFLES = 16  # orders tried for each timed cycle (timing_rows)
# How the run's sampler orders the examples (a recipe lever: the order is what is trained on), as
# transformers' TrainingArguments names it (train_sampling_strategy; group_by_length=True before 5.x):
# at random, or sorted by length within mega-batches (LengthGroupedSampler), so that a micro-batch's
# rows are of about one length and pad little.
SAMPLINGS = ("random", "group_by_length")
DEFAULT_SAMPLING = "random"


@dataclass(frozen=True, slots=True)
class Lengths:
    """A data set's example lengths in tokens, as QUANTILES quantiles (sorted)."""

    points: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.points) != QUANTILES or any(not isinstance(p, int) or p < 1 for p in self.points):
            raise BadInput(f"example lengths must be {QUANTILES} whole numbers of at least 1")
        if list(self.points) != sorted(self.points):
            raise BadInput("example lengths must be sorted")

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Lengths:
        """The quantiles of `lengths` (every example's token count, at least one)."""
        ordered = sorted(max(1, int(n)) for n in lengths)
        if not ordered:
            raise BadInput("no example to measure lengths of")
        count = len(ordered)
        return cls(tuple(ordered[min(count - 1, int((i + 0.5) * count / QUANTILES))] for i in range(QUANTILES)))

    @classmethod
    def from_text(cls, text: str) -> Lengths:
        if not text.startswith(PREFIX):
            raise BadInput(f"stored example lengths {text[:20]!r}... are not of a form this autotune reads")
        try:
            return cls(tuple(int(p) for p in text[len(PREFIX) :].split(",")))
        except ValueError:
            raise BadInput(f"stored example lengths {text[:20]!r}... cannot be read") from None

    def to_text(self) -> str:
        """The form a config's key and a stored probe keep ('q12,14,...')."""
        return PREFIX + ",".join(map(str, self.points))

    @property
    def longest(self) -> int:
        return self.points[-1]

    def mean(self, block: int) -> float:
        """An example's tokens once truncated at `block` (what the run trains on)."""
        return sum(min(p, block) for p in self.points) / QUANTILES

    def describe(self, block: int) -> str:
        """'mean 34, median 24, 90% under 77 tokens' of the examples truncated at `block`."""
        cut = [min(p, block) for p in self.points]
        return (
            f"mean {self.mean(block):,.0f}, median {cut[QUANTILES // 2]:,}, 90% at most "
            f"{cut[int(0.9 * QUANTILES)]:,} tokens"
        )


@functools.lru_cache(maxsize=1024)
def expected_padded_row(text: str, rows: int, block: int) -> float:
    """The expected tokens of each row of a batch of `rows` examples padded to its longest (truncated
    at `block`): E[max of `rows` draws], from the quantiles' distribution."""
    cut = sorted(min(p, block) for p in Lengths.from_text(text).points)
    # P(max <= cut[i]) = ((i + 1) / Q) ** rows; the expectation sums each value by the chance it is the max.
    total, below = 0.0, 0.0
    for i, value in enumerate(cut):
        at_most = ((i + 1) / QUANTILES) ** rows
        total += value * (at_most - below)
        below = at_most
    return total


def padded_row(text: str, micro_batch: int, rows_per_step: int, block: int, sampling: str = DEFAULT_SAMPLING) -> float:
    """The expected tokens of each row of a micro-batch padded to its longest, as the run's sampler
    draws them: at random (expected_padded_row), or grouped by length (the timed cycle's sorted rows:
    grouped_rows)."""
    if sampling == DEFAULT_SAMPLING:
        return expected_padded_row(text, micro_batch, block)
    rows = grouped_rows(text, rows_per_step, block)
    return sum(micro_batch * max(rows[i : i + micro_batch]) for i in range(0, len(rows), micro_batch)) / len(rows)


def padding_share(
    text: str, rows: int, block: int, *, rows_per_step: int | None = None, sampling: str = DEFAULT_SAMPLING
) -> float:
    """The share of a padded batch's tokens that are padding, expected."""
    padded = padded_row(text, rows, rows_per_step or rows, block, sampling)
    return 1.0 - Lengths.from_text(text).mean(block) / padded


def real_tokens_per_row(text: str, block: int) -> float:
    return Lengths.from_text(text).mean(block)


def cycle_steps(rows_per_step: int) -> int:
    """Optimizer steps of `rows_per_step` examples that draw every quantile equally often (at
    least 2): the timed window of a padded run is a whole number of these cycles, so that its rows'
    mean is the data's and its real tokens per step are exactly `real_tokens_per_row` times the rows."""
    return max(2, QUANTILES // math.gcd(QUANTILES, rows_per_step))


def grouped_rows(text: str, rows_per_step: int, block: int) -> list[int]:
    """A timed cycle's rows as transformers' LengthGroupedSampler orders them: every quantile
    equally often, longest first, so that consecutive rows (a micro-batch) are of about one length.
    The sampler sorts mega-batches of 50 optimizer steps' rows; the cycle, of fewer, groups a little
    more coarsely: it pads no less than the run does."""
    points = sorted((min(p, block) for p in Lengths.from_text(text).points), reverse=True)
    copies = cycle_steps(rows_per_step) * rows_per_step // QUANTILES
    return [p for p in points for _ in range(copies)]


def timing_rows(
    text: str, micro_batch: int, rows_per_step: int, block: int, cycle: int, sampling: str = DEFAULT_SAMPLING
) -> list[int]:
    """The example lengths (truncated at `block`) of the `cycle`-th cycle of a run's steps, in the
    order a random sampler would draw them: each quantile equally often, so that the cycle's real
    tokens are exactly the data's mean times its rows. Of SHUFFLES seeded orders (seeded by the
    cycle: every process draws the same), the one whose micro-batches of `micro_batch` consecutive
    rows pad to the expected positions most nearly: one cycle's grouping then stands for the
    data's, where a single random order of 64 rows in 8 batches of 8 pads 5% more or less. Grouped
    by length: grouped_rows, every cycle alike."""
    if sampling != DEFAULT_SAMPLING:
        return grouped_rows(text, rows_per_step, block)
    points = [min(p, block) for p in Lengths.from_text(text).points]
    drawn = points * (cycle_steps(rows_per_step) * rows_per_step // QUANTILES)
    expected = expected_padded_row(text, micro_batch, block) * len(drawn)
    best: tuple[float, list[int]] | None = None
    for seed in range(SHUFFLES):
        order = list(drawn)
        random.Random(cycle * SHUFFLES + seed).shuffle(order)
        padded = sum(micro_batch * max(order[i : i + micro_batch]) for i in range(0, len(order), micro_batch))
        if best is None or abs(padded - expected) < best[0]:
            best = (abs(padded - expected), order)
    assert best is not None
    return best[1]
