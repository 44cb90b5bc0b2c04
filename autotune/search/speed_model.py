"""The search's model of speed on this device for this model: every candidate's tokens/s predicted
from the probes measured so far, with how far off the prediction may be. Torch-free (numpy).

A candidate is described by what it is made of: its precision, checkpointing, attention kernel,
optimizer, weights, speed levers, block size and micro-batch. The model is linear in the log of
the seconds each token takes (a product of factors, one per lever value):

    log(seconds per token of c) = x(c) . theta + noise

- `x(c)`: one indicator per lever value other than the space's reference (fp32, no checkpointing,
  sdpa, the largest micro-batch and block...), an intercept (this card and model's own speed,
  unknown until the first probe), and interactions: each pair of lever values (checkpointing
  costs more in bf16 than in fp32: measured 0.42x against 0.69x on a CPU), and each lever value
  times log2 of the micro-batch (half precision gains more from a larger micro-batch).
- `theta` has a prior for each feature (`Prior`): where the physics says which way a lever goes
  (checkpointing recomputes the forward; tensor cores make half precision faster on CUDA), its
  mean says so; its spread says how little is known. Each probe measured refits the posterior
  (Bayesian linear regression, closed form), so that one probe of a precision calibrates every
  configuration with that precision, and interactions are learnt where both levers were measured.
- noise: each measurement's own spread (the probe's step spread), at least the device's noise
  floor (`Departures`): what one window of steps misses of a config's speed.

A prediction has a central figure and an optimistic one, OPTIMISM standard deviations faster: the
speed the candidate could still reach given what was measured. The search probes a candidate only
while its optimistic figure beats the best measured one (search/strategies.py, PredictiveStrategy).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult

# Standard deviations of optimism: a candidate may still win while its speed, this far above the
# model's central prediction, beats the best measured (one-sided: about 98% of outcomes below).
OPTIMISM = 2.0
# The intercept's spread: a card and model's absolute speed is unknown until it is measured.
UNKNOWN = 30.0


@dataclass(frozen=True, slots=True)
class Prior:
    mean: float  # on log(seconds per token): negative is faster
    spread: float  # standard deviation


@dataclass(frozen=True, slots=True)
class Departures:
    """How far a device's speed may depart from a product of lever factors (spreads, on the log)."""

    pair: float  # two lever values together (checkpointing in bf16 against in fp32)
    speed_lever_pair: float  # compile, the allocator or Liger with another lever value
    slope: float  # a lever value's change of the gain of each doubling of the micro-batch
    noise: float  # the least error of a measurement, and of a prediction
    # Whether a larger micro-batch of a family is never slower (space.micro_batch_family): fewer,
    # fuller micro-steps on a GPU; a small model on a CPU can run faster in smaller ones, whose
    # activations stay in its caches (measured: a tiny GPT-2's mb8 at 38,209 tokens/s, its mb16 30,582).
    monotone_micro_batch: bool


# CUDA: first figures, to be held against GPU studies (issue "GPU evidence"). CPU: from the studies
# under benchmarks/results/studies: checkpointing cost 0.42x in bf16 against 0.69x in fp32,
# torch.compile gained 1.18x to 2.3x across precisions and checkpointing, and one window of a few
# seconds reads 5-10% off another of the same config (search/confirm.py).
DEPARTURES = {
    "cuda": Departures(pair=0.15, speed_lever_pair=0.08, slope=0.1, noise=0.03, monotone_micro_batch=True),
    "cpu": Departures(pair=0.25, speed_lever_pair=0.35, slope=0.1, noise=0.08, monotone_micro_batch=False),
}
SPEED_LEVERS = ("compile", "allocator", "liger")

# Levers the model describes a configuration by, with their reference value (the factor 1) when
# the space has it; otherwise the first value found is the reference.
LEVERS = ("precision", "checkpointing", "attention", "optimizer", "weights", *SPEED_LEVERS, "strategy", "padding_free")
REFERENCE = {
    "precision": "fp32",
    "checkpointing": False,
    "attention": "sdpa",
    "optimizer": "adamw",
    "weights": "fp32",
    "compile": False,
    "allocator": "default",
    "liger": False,
    "strategy": "ddp",
    "padding_free": False,
}
# How much slower than DDP each sharing of a run across ranks is expected, on the log, before any is
# measured: FSDP gathers each layer's parameters in forward (and again in backward when it
# reshards) where DDP all-reduces the gradients once, and overlaps most of it with compute over
# NVLink (planner/speed.py counts the bytes); offload adds host copies and steps the optimizer on
# the CPU. Wide spreads: over PCIe, gloo or a slow host these change several-fold (measured on 2 CPU
# ranks over gloo: fsdp 2.8x slower than ddp on a tiny GPT-2).
STRATEGY_PRIORS = {
    "fsdp-grad-op": Prior(math.log(1.05), 0.5),
    "fsdp": Prior(math.log(1.15), 0.6),
    "fsdp-offload": Prior(math.log(2.0), 0.8),
}
# Tokens per micro-step at which a card's matmuls reach half their ceiling (planner/speed.py's
# T_HALF_TOKENS); on a CPU far fewer fill the cores. Only the prior of the micro-batch's effect.
HALF_FILL_TOKENS = {"cuda": 1024, "cpu": 256}
# The micro-batch's effect is that curve times a factor shared by every micro-batch of the space
# (FILL: how much of the curve this card and model show), plus each micro-batch's own departure
# (MICRO_BATCH_SPREAD): two micro-batches measured teach the factor, so that a third, never
# measured, is predicted from them and not from the curve alone (on a 2-core CPU a tiny GPT-2 ran
# as fast per token at micro-batch 2 as at 8, where the curve said 2.6x slower).
FILL = Prior(1.0, 0.5)
MICRO_BATCH_SPREAD = 0.3
BLOCK_SPREAD = 0.5


def lever_prior(lever: str, value: object, device_type: str) -> Prior:
    """What is known before measuring of a lever value's effect on seconds per token."""
    cuda = device_type == "cuda"
    if lever == "precision":
        if value in ("fp16", "bf16"):  # tensor cores on CUDA; on a CPU it depends on the cores (AMX, AVX512-BF16)
            return Prior(-0.7, 0.5) if cuda else Prior(0.0, 1.0)
        if value == "tf32":
            return Prior(-0.4, 0.4) if cuda else Prior(0.0, 0.1)
    if lever == "checkpointing":
        return Prior(math.log(4 / 3), 0.12)  # one more forward of three passes; never faster
    if lever == "attention":
        return Prior(0.1 if value == "eager" else 0.0, 0.3)
    if lever == "weights":
        return Prior(-0.2, 0.5)
    if lever == "compile":
        return Prior(-0.15 if cuda else 0.0, 0.3 if cuda else 0.5)
    if lever == "allocator":
        return Prior(0.0, 0.02)  # the same kernels: only where memory is allocated differs
    if lever == "liger":
        return Prior(-0.05, 0.2)
    if lever == "strategy":
        return STRATEGY_PRIORS.get(str(value), Prior(0.0, 0.6))
    return Prior(0.0, 0.3)


@dataclass(frozen=True, slots=True)
class SpeedGuess:
    """One candidate's predicted speed."""

    tokens_per_s: float  # the model's central figure
    optimistic_tokens_per_s: float  # OPTIMISM standard deviations faster
    spread: float  # the standard deviation, relative (on the log)
    measured: int  # probes the model was fitted to
    capped_by: str | None = None  # why it can be no faster (structure), when that holds it below the model

    def capped(self, tokens_per_s: float, why: str) -> SpeedGuess:
        """This guess held to at most `tokens_per_s`, because of `why` (structure, not the model)."""
        if self.optimistic_tokens_per_s <= tokens_per_s:
            return self
        return replace(
            self, tokens_per_s=min(self.tokens_per_s, tokens_per_s), optimistic_tokens_per_s=tokens_per_s, capped_by=why
        )

    def describe(self) -> str:
        if self.capped_by is not None:
            return f"at most {self.optimistic_tokens_per_s:,.0f} tokens/s: {self.capped_by} that"
        return (
            f"predicted {self.tokens_per_s:,.0f} tokens/s, at most {self.optimistic_tokens_per_s:,.0f} "
            f"(the speed model fitted to {self.measured} probes)"
        )


class SpeedModel:
    """The features and priors of a space's candidates; `fit` to what was measured."""

    def __init__(self, candidates: list[ProbeConfig], device_type: str) -> None:
        self.device_type = device_type
        self.departures = DEPARTURES.get(device_type, DEPARTURES["cuda"])
        self.references = {lever: _reference(lever, candidates) for lever in LEVERS}
        self.largest_micro_batch = max(c.micro_batch for c in candidates)
        self.largest_block = max(c.block_size for c in candidates)
        # (positions per sequence, padding included: what fills the cores; the rows' kind is part of the
        # key: grouped and padding-free rows of one micro-batch pad less than random ones)
        self.tokens_per_sequence = {
            _rows(c, c.micro_batch): c.padded_tokens_per_step / c.effective_batch for c in candidates
        }
        names: dict[str, Prior] = {"intercept": Prior(0.0, UNKNOWN)}
        for config in candidates:
            for name in self._names(config):
                if name not in names:
                    names[name] = self._prior(name, config)
        self.names = list(names)
        self.priors = [names[n] for n in self.names]
        self.index = {n: i for i, n in enumerate(self.names)}
        self._rows: dict[str, list[float]] = {}

    # -- features -----------------------------------------------------------------------------------
    def _levers(self, config: ProbeConfig) -> list[str]:
        """The lever values of `config` other than the references, as feature names."""
        return [
            f"{lever}={getattr(config, lever)}" for lever in LEVERS if getattr(config, lever) != self.references[lever]
        ]

    def _doublings(self, config: ProbeConfig) -> float:
        """How many times smaller than the space's largest micro-batch `config`'s is (log2)."""
        return math.log2(self.largest_micro_batch / config.micro_batch)

    def _names(self, config: ProbeConfig) -> list[str]:
        levers = self._levers(config)
        names = list(levers)
        if config.micro_batch != self.largest_micro_batch:
            names += ["micro_batch_fill", f"micro_batch={config.micro_batch}"]
            names += [f"{lever}*doublings" for lever in levers]
        if config.block_size != self.largest_block:
            names.append(f"block_size={config.block_size}")
        names += [f"{a}&{b}" for a, b in itertools.combinations(levers, 2)]
        return names

    def _prior(self, name: str, config: ProbeConfig) -> Prior:
        speed_lever = any(part.startswith(SPEED_LEVERS) for part in name.split("&"))
        if "&" in name:
            return Prior(0.0, self.departures.speed_lever_pair if speed_lever else self.departures.pair)
        if name.endswith("*doublings"):
            return Prior(0.0, self.departures.slope)
        if name == "micro_batch_fill":
            return FILL
        lever, _, _ = name.partition("=")
        if lever == "micro_batch":
            return Prior(0.0, MICRO_BATCH_SPREAD)
        if lever == "block_size":
            return Prior(0.0, BLOCK_SPREAD)
        if lever == "padding_free":
            # Per position computed (the padding it drops is counted apart: padded_per_real), one row
            # of the micro-batch's examples end to end. A varlen kernel (flash attention) takes each
            # example alone: about a padded row's speed. Any other spans the whole row, masked block
            # by block: attention over (n x mean)^2 positions where padded rows had n x longest^2,
            # which can be more on long examples: wide, so that a padded config is still measured
            # unless its padding is well beyond what that could cost.
            return Prior(0.0, 0.2 if config.attention.startswith("flash") else 0.5)
        return lever_prior(lever, getattr(config, lever), self.device_type)

    def _fill(self, config: ProbeConfig) -> float:
        """The curve of a small micro-step's idle cores: seconds per token ~ 1 + T/t for t tokens per
        micro-step (padding included), on the log, against the space's largest micro-batch."""
        half = HALF_FILL_TOKENS.get(self.device_type, HALF_FILL_TOKENS["cuda"])
        per_sequence = self.tokens_per_sequence[_rows(config, config.micro_batch)]
        largest = self.tokens_per_sequence.get(_rows(config, self.largest_micro_batch), per_sequence)
        return math.log(
            (1 + half / (config.micro_batch * per_sequence)) / (1 + half / (self.largest_micro_batch * largest))
        )

    def row(self, config: ProbeConfig) -> list[float]:
        """x(config): the feature values of `config`."""
        row = self._rows.get(config.key())
        if row is None:
            row = [0.0] * len(self.names)
            row[0] = 1.0
            doublings = self._doublings(config)
            for name in self._names(config):
                row[self.index[name]] = (
                    doublings
                    if name.endswith("*doublings")
                    else self._fill(config)
                    if name == "micro_batch_fill"
                    else 1.0
                )
            self._rows[config.key()] = row
        return row

    # -- fitting ------------------------------------------------------------------------------------
    def fit(self, measured: Iterable[tuple[ProbeConfig, ProbeResult]]) -> FittedSpeed:
        """The posterior given the measured configs (those with a throughput)."""
        import numpy as np

        # The model's work per second (padding included: autotune.levers.lengths), which the levers' factors describe.
        points = [
            (c, r, r.tokens_per_s * c.padded_per_real) for c, r in measured if r.tokens_per_s and r.tokens_per_s > 0
        ]
        prior_mean = np.array([p.mean for p in self.priors])
        prior_precision = np.diag([1.0 / p.spread**2 for p in self.priors])
        precision, weighted = prior_precision.copy(), prior_precision @ prior_mean
        if points:
            x = np.array([self.row(c) for c, _, _ in points])
            y = np.array([-math.log(speed) for _, _, speed in points])  # log seconds per token
            floor = self.departures.noise
            w = np.array([1.0 / max(floor, r.step_spread or 0.0) ** 2 for _, r, _ in points])
            precision += x.T @ (x * w[:, None])
            weighted += x.T @ (w * y)
        covariance = np.linalg.inv(precision)
        return FittedSpeed(self, covariance @ weighted, covariance, len(points))


def _rows(config: ProbeConfig, micro_batch: int) -> tuple:
    """The kind of micro-batch `config` makes at `micro_batch` rows: its block, and how its rows are
    drawn and laid out (the sampler, padding-free)."""
    return (config.block_size, micro_batch, config.sampling, config.padding_free)


def _reference(lever: str, candidates: list[ProbeConfig]) -> object:
    values = list(dict.fromkeys(getattr(c, lever) for c in candidates))
    return REFERENCE[lever] if REFERENCE[lever] in values else values[0]


class FittedSpeed:
    """The speed model after `measured` probes: a prediction for any candidate of the space."""

    def __init__(self, model: SpeedModel, mean, covariance, measured: int) -> None:
        self.model, self.mean, self.covariance, self.measured = model, mean, covariance, measured

    def guess(self, config: ProbeConfig) -> SpeedGuess:
        import numpy as np

        x = np.array(self.model.row(config))
        centre = float(x @ self.mean)
        spread = math.sqrt(float(x @ self.covariance @ x) + self.model.departures.noise**2)
        real = 1.0 / config.padded_per_real  # (back to real tokens per second)
        return SpeedGuess(
            tokens_per_s=real * math.exp(-centre),
            optimistic_tokens_per_s=real * math.exp(-(centre - OPTIMISM * spread)),
            spread=spread,
            measured=self.measured,
        )
