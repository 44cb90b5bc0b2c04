"""Which members of a group (configs that differ only in micro-batch, space.group_key) to trace,
and how the others are told from them: shared by the search's predictions and `autotune plan`,
so that a search after a plan of the same space finds every trace it needs in the cache.

The peak is the largest of a few phases' needs (the forward's saved activations, the backward's
gradients, the optimizer step's state), each affine in the micro-batch: their maximum is convex,
so a chord between two traces never predicts less than a trace would. Where the phase of the peak
changes inside a group, a third trace in the middle keeps the chords within about 1%
(tests/planner/test_plan.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from autotune.levers.config import ProbeConfig

if TYPE_CHECKING:
    from autotune.estimate.result import MemoryEstimate


class Traced(Protocol):
    @property
    def config(self) -> ProbeConfig: ...


T = TypeVar("T", bound=Traced)

# How far an interpolated peak was found above the trace of the same config, at worst: +0.6% over
# the tiny GPT-2, BERT classifier and Pegasus groups of benchmarks/interpolation.py (with and without
# an eval phase, sdpa and eager), once each phase is interpolated on its own (before: +15.3%, the
# chord of the largest phase). Stated with room: a search deflates an interpolated floor by it
# before skipping a config unprobed (search/predictions.py), so that a chord's overshoot is never
# a false skip.
INTERPOLATION_OVERSHOOT = 0.02


def traced_members(members: Sequence[ProbeConfig]) -> list[ProbeConfig]:
    """Of a group sorted by micro-batch, those to trace: the smallest, the largest, and for four or
    more the middle one too."""
    if len(members) < 4:
        return list(dict.fromkeys((members[0], members[-1])))
    return list(dict.fromkeys((members[0], members[len(members) // 2], members[-1])))


def between(config: ProbeConfig, traced: Sequence[T]) -> tuple[T, T, float]:
    """The traced estimates on either side of `config` (sorted by micro-batch, at least one) and
    where `config` lies between them, from 0 (the lower) to 1 (the upper)."""
    high = next((e for e in traced if e.config.micro_batch > config.micro_batch), traced[-1])
    lower = [e for e in traced if e.config.micro_batch < high.config.micro_batch]
    low = max(lower, key=lambda e: e.config.micro_batch) if lower else high
    span = high.config.micro_batch - low.config.micro_batch
    return low, high, (config.micro_batch - low.config.micro_batch) / span if span else 0.0


def interpolated(config: ProbeConfig, low: MemoryEstimate, high: MemoryEstimate, t: float) -> MemoryEstimate:
    """`config`'s estimate a share `t` of the way from trace `low` to trace `high`: what grows with
    the micro-batch (activations, temporaries, the peak and reserved) linearly, the rest (weights,
    gradients, optimizer state, workspaces, context) as the traces have it."""

    def part(name: str) -> int:
        return round(getattr(low, name) + t * (getattr(high, name) - getattr(low, name)))

    def between_peaks(phase: str) -> dict[str, int]:
        a, b = low.phase_peaks[phase], high.phase_peaks[phase]
        return {name: round(a[name] + t * (b[name] - a[name])) for name in a}

    # Each phase's peaks (the eval phase's grow only with the training batches held: nearly flat), and
    # the config's peaks their largest, as a trace's are: a chord of the largest would overshoot where
    # the phase that peaks changes between the traces (eval at the small end, train at the large end:
    # +15% seen on a tiny GPT-2 with --eval-batch 8), while each phase's own chord follows it.
    phase_peaks = {phase: between_peaks(phase) for phase in low.phase_peaks if phase in high.phase_peaks}
    peak, reserved = part("peak_bytes"), part("reserved_bytes")
    if phase_peaks and set(phase_peaks) == set(low.phase_peaks) == set(high.phase_peaks):
        peak = min(peak, max(p["allocated"] for p in phase_peaks.values()))
        reserved = min(reserved, max(p["reserved"] for p in phase_peaks.values()))
    activations, temporaries = part("activations"), part("temporaries")
    # What was live at the peak still adds up to it (MemoryEstimate's breakdown): the share that grows
    # with the micro-batch takes the difference.
    temporaries = max(0, peak - (low.params + low.grads + low.optimizer + activations + low.workspace))
    activations = peak - (low.params + low.grads + low.optimizer + temporaries + low.workspace)
    return dataclasses.replace(
        low,
        config=config,
        activations=activations,
        temporaries=temporaries,
        peak_bytes=peak,
        reserved_bytes=reserved,
        seconds=0.0,
        trace_seconds=0.0,
        cached=False,
        phase_peaks=phase_peaks,
        notes=(*low.notes, "interpolated between the group's traced micro-batches"),
    )
