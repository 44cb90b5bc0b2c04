"""Step times and their spread: what a probe's timed window measured, and how noisy it was.

A probe times each optimizer step of its window (the step ends by reading its loss, a host sync,
so every duration is the step's own). Throughput is taken from the median step, which one slow
step (a page fault, a neighbour on a shared machine) does not move; the spread is half the
interquartile range relative to the median, so "1,200 tokens/s +-3%" reads as where the middle
half of the steps fell. Torch-free: the search reads it to decide which picks are within noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# Below this relative difference two throughputs are not told apart, however steady each looked:
# a window of a few steps underestimates its own spread.
NOISE_FLOOR = 0.02


def median_seconds(step_times: Sequence[float]) -> float:
    return statistics.median(step_times)


def relative_spread(step_times: Sequence[float]) -> float | None:
    """Half the interquartile range over the median (None for fewer than two steps). Quartiles
    interpolate between steps ('inclusive'), so that a window of three steps has one."""
    if len(step_times) < 2:
        return None
    q1, _, q3 = statistics.quantiles(step_times, n=4, method="inclusive")
    middle = statistics.median(step_times)
    return (q3 - q1) / (2 * middle) if middle > 0 else None


def window_seconds(step_times: Sequence[float], cycle: int | None = None) -> tuple[float, float | None]:
    """A window's seconds per step and its spread. Steps of one shape (`cycle` None): the median
    step and relative_spread. Steps of batches drawn from the data's lengths (autotune.levers.lengths),
    timed in whole cycles of `cycle` steps: the mean step, since the run's time is the sum of its
    steps, long batches and short alike (a median would leave the long ones out); the spread is
    that of the cycles' means, each cycle drawing the data's lengths alike, so that it is the noise
    between repeats and not the spread of the batches' sizes."""
    if cycle is None:
        return median_seconds(step_times), relative_spread(step_times)
    means = [statistics.fmean(step_times[i : i + cycle]) for i in range(0, len(step_times) - cycle + 1, cycle)]
    whole = len(means) * cycle or len(step_times)
    return statistics.fmean(step_times[:whole]), relative_spread(means)


def noise(*spreads: float | None) -> float:
    """The relative difference within which throughputs with these spreads are not told apart."""
    return max(NOISE_FLOOR, sum(s or 0.0 for s in spreads))
