"""Predicted memory of the candidates, from the estimator, before anything is probed."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import ProbeConfig
from autotune.space import group_key


@dataclass(frozen=True, slots=True)
class Prediction:
    peak_bytes: int        # predicted peak allocated (stored beside the measurement)
    floor_bytes: int       # peak allocated + context: a floor of what the config needs
    required_bytes: int    # predicted peak reserved + context: what the probe's fit rule compares


def predict(candidates: list[ProbeConfig], device_type: str, *, trust_remote_code: bool = False) -> dict[str, Prediction]:
    """Predicted memory of every candidate from two traces per group (smallest and largest
    micro-batch), interpolated: inside a group the need is affine in the micro-batch (fixed
    weights, gradients and optimizer state; activations per sequence)."""
    from autotune.estimate import estimate_memories

    groups: dict[tuple, list[ProbeConfig]] = {}
    for config in candidates:
        groups.setdefault(group_key(config), []).append(config)
    ends = {}
    for members in groups.values():
        members.sort(key=lambda c: c.micro_batch)
        ends[group_key(members[0])] = (members[0], members[-1])
    to_trace = list(dict.fromkeys(c for pair in ends.values() for c in pair))
    estimates = {e.config.key(): e for e in estimate_memories(to_trace, device_type=device_type,
                                                              trust_remote_code=trust_remote_code)}
    out: dict[str, Prediction] = {}
    for key, (low, high) in ends.items():
        a, b = estimates[low.key()], estimates[high.key()]
        span = high.micro_batch - low.micro_batch
        for config in groups[key]:
            t = (config.micro_batch - low.micro_batch) / span if span else 0.0
            peak = round(a.peak_bytes + t * (b.peak_bytes - a.peak_bytes))
            reserved = round(a.reserved_bytes + t * (b.reserved_bytes - a.reserved_bytes))
            out[config.key()] = Prediction(peak, peak + a.context_bytes, reserved + a.context_bytes)
    return out
