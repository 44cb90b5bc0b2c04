"""Predicted memory of the candidates, from the estimator: before anything is probed, or in the
background while the first probes run (`Predicting`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import AutotuneError
from autotune.estimate.interpolate import INTERPOLATION_OVERSHOOT, between, interpolated, traced_members
from autotune.estimate.launch import TraceChildren
from autotune.search.space import group_key, group_priority


@dataclass(frozen=True, slots=True)
class Prediction:
    peak_bytes: int  # predicted peak allocated (stored beside the measurement)
    floor_bytes: int  # peak allocated + context: a floor of what the config needs
    required_bytes: int  # predicted peak reserved + context: what the probe's fit rule compares


def predict(
    candidates: list[ProbeConfig],
    device_type: str,
    *,
    trust_remote_code: bool = False,
    children: TraceChildren | None = None,
    on_predictions: Callable[[dict[str, Prediction]], None] | None = None,
) -> dict[str, Prediction]:
    """Predicted memory of every candidate from two or three traces per group (smallest, largest,
    and middle micro-batch: estimate/interpolate.py), interpolated between: inside a group the
    need grows piecewise affinely with the micro-batch (fixed weights, gradients and optimizer
    state; activations per sequence). Traced by `children` when
    they were started ahead, groups in the order the search visits them; each group's
    predictions are also given to `on_predictions` as soon as both its traces are in."""
    from autotune.estimate import MemoryEstimate, estimate_memories

    groups: dict[tuple, list[ProbeConfig]] = {}
    for config in sorted(candidates, key=lambda c: group_priority(c, device_type)):
        groups.setdefault(group_key(config), []).append(config)
    ends = {}
    for members in groups.values():
        members.sort(key=lambda c: c.micro_batch)
        ends[group_key(members[0])] = traced_members(members)
    estimates: dict[str, MemoryEstimate] = {}
    out: dict[str, Prediction] = {}

    def arrived(estimate: MemoryEstimate) -> None:
        estimates[estimate.config.key()] = estimate
        for key, traced in ends.items():
            if groups[key][0].key() not in out and all(c.key() in estimates for c in traced):
                predicted = _interpolate(groups[key], [estimates[c.key()] for c in traced])
                out.update(predicted)
                if on_predictions is not None:
                    on_predictions(predicted)

    to_trace = list(dict.fromkeys(c for traced in ends.values() for c in traced))
    estimate_memories(
        to_trace, device_type=device_type, trust_remote_code=trust_remote_code, children=children, on_estimate=arrived
    )
    return out


def _interpolate(members: list[ProbeConfig], traced: list) -> dict[str, Prediction]:
    """Predictions of a group's members (by micro-batch) between its traced members' estimates. A
    floor must not overstate: an interpolated one is lowered by the interpolation's stated overshoot
    (a chord of convex needs lies above them)."""
    out = {}
    traced_keys = {estimate.config.key() for estimate in traced}
    for config in members:
        e = interpolated(config, *between(config, traced))
        floor = e.floor_bytes
        if config.key() not in traced_keys:
            floor = e.context_bytes + math.floor(e.peak_bytes * (1 - INTERPOLATION_OVERSHOOT))
        out[config.key()] = Prediction(e.peak_bytes, floor, e.required_bytes)
    return out


class Predicting:
    """Predictions of `configs` computed in a thread while the search goes on. With `streaming`, `compute` is
    given `on_predictions` and each group's predictions can be taken as soon as they are in
    (`take`); `wait_for` a config's. A user error or a failed trace comes back as `error`
    (predictions only order and prune the probes)."""

    def __init__(
        self, compute: Callable[..., dict[str, Prediction]], configs: list[ProbeConfig], streaming: bool = False
    ) -> None:
        self.error: AutotuneError | None = None
        self._wanted = {c.key() for c in configs}
        self._delivered: dict[str, Prediction] = {}
        self._taken: set[str] = set()
        self._done = False
        self._arrival = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, args=(compute, streaming), name="autotune-predictions", daemon=True
        )
        self._thread.start()

    def _run(self, compute: Callable[..., dict[str, Prediction]], streaming: bool) -> None:
        try:
            self._deliver(compute(on_predictions=self._deliver) if streaming else compute())
        except AutotuneError as exc:
            self.error = exc
        finally:
            with self._arrival:
                self._done = True
                self._arrival.notify_all()

    def _deliver(self, predictions: dict[str, Prediction]) -> None:
        with self._arrival:
            self._delivered.update(predictions)
            self._arrival.notify_all()

    @property
    def ready(self) -> bool:
        """Every prediction is in (or failed)."""
        with self._arrival:
            return self._done

    def take(self) -> dict[str, Prediction]:
        """The predictions that arrived since the last take."""
        with self._arrival:
            new = {key: p for key, p in self._delivered.items() if key not in self._taken}
            self._taken.update(new)
        return new

    def expects(self, config: ProbeConfig) -> bool:
        """`config`'s prediction is coming and not yet taken: being computed, or in and not yet
        taken. (Not "not yet in": a search that chose `config` on what it had taken, while its
        group's predictions landed, would probe that stale choice, a binary search's step where the
        prediction itself was in.)"""
        with self._arrival:
            key = config.key()
            return key in self._wanted and key not in self._taken and (key in self._delivered or not self._done)

    def wait_for(self, config: ProbeConfig, timeout: float | None = None) -> None:
        """Until `config`'s prediction is in, no more will come, or `timeout` seconds have passed."""
        with self._arrival:
            self._arrival.wait_for(
                lambda: config.key() in self._delivered or self._done,
                timeout=None if timeout is None or timeout == math.inf else timeout,
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Until every prediction is in, or `timeout` seconds have passed; whether they are."""
        self._thread.join(None if timeout is None or timeout == math.inf else timeout)
        return not self._thread.is_alive()
