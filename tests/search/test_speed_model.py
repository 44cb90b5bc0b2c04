"""The search's speed model: priors before any probe, a fit that learns each lever from one probe
of it, and predictions whose optimism shrinks with what is measured."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autotune.specs.models import resolve_model
from autotune.results.probe_result import ProbeResult
from autotune.search.speed_model import DEPARTURES, OPTIMISM, SpeedModel
from autotune.search.space import SearchSpace

TOKENS = 8 * 512
FACTORS = {"fp16": 0.5, "bf16": 0.45, "fp32": 1.0}


@pytest.fixture(scope="module")
def candidates():
    return SearchSpace.build(
        resolve_model("gpt2")
    ).candidates()  # 48: 3 precisions x ckpt x 2 kernels x 4 micro-batches


def true_speed(c) -> float:
    """A product of lever factors: what the model can represent exactly."""
    seconds = FACTORS[c.precision] * (1.3 if c.checkpointing else 1.0) * (1.1 if c.attention == "eager" else 1.0)
    seconds *= 1 + 4 / c.micro_batch
    return 10_000 / seconds


def measured(c, spread: float | None = 0.01) -> ProbeResult:
    return ProbeResult(status="ok", tokens_per_s=true_speed(c), step_seconds=TOKENS / true_speed(c), step_spread=spread)


def test_before_any_probe_the_prior_orders_by_what_the_physics_says(candidates):
    fitted = SpeedModel(candidates, "cuda").fit([])
    by = {(c.precision, c.checkpointing, c.attention, c.micro_batch): fitted.guess(c) for c in candidates}
    # Tensor cores on CUDA: half precision first; checkpointing and eager attention slower; larger micro-batches faster.
    assert by[("bf16", False, "sdpa", 8)].tokens_per_s > by[("fp32", False, "sdpa", 8)].tokens_per_s
    assert by[("bf16", True, "sdpa", 8)].tokens_per_s < by[("bf16", False, "sdpa", 8)].tokens_per_s
    assert by[("bf16", False, "eager", 8)].tokens_per_s < by[("bf16", False, "sdpa", 8)].tokens_per_s
    assert by[("bf16", False, "sdpa", 1)].tokens_per_s < by[("bf16", False, "sdpa", 8)].tokens_per_s
    # ...and knows nothing of the absolute speed: every optimistic figure is enormous.
    assert all(g.optimistic_tokens_per_s > 1e9 * g.tokens_per_s for g in by.values())


def test_one_probe_per_lever_calibrates_every_config(candidates):
    model = SpeedModel(candidates, "cuda")
    base = next(
        c
        for c in candidates
        if (c.precision, c.checkpointing, c.attention, c.micro_batch) == ("fp32", False, "sdpa", 8)
    )
    probes = [
        base,
        replace(base, precision="bf16"),
        replace(base, precision="fp16"),
        replace(base, checkpointing=True),
        replace(base, attention="eager"),
    ]
    probes += [replace(base, micro_batch=m, grad_accum=8 // m) for m in (1, 2, 4)]
    fitted = model.fit([(c, measured(c)) for c in probes])
    for c in candidates:
        guess = fitted.guess(c)
        # The truth is a product of factors: every prediction lands within a few percent...
        assert guess.tokens_per_s == pytest.approx(true_speed(c), rel=0.05), c.label()
        # ...and the optimistic figure is above it: by little for a lever measured on its own, by
        # more where untested interactions may act (checkpointing in fp16, a smaller micro-batch).
        assert true_speed(c) <= guess.optimistic_tokens_per_s, c.label()
        levers = (c.precision != "fp32") + c.checkpointing + (c.attention != "sdpa")
        if c.micro_batch == 8 and levers <= 1:
            assert guess.optimistic_tokens_per_s <= true_speed(c) * 1.2, c.label()
    # A config measured: its prediction is its measurement, optimism the noise floor's.
    guess = fitted.guess(base)
    assert guess.tokens_per_s == pytest.approx(true_speed(base), rel=0.01)
    assert (
        guess.optimistic_tokens_per_s / guess.tokens_per_s == pytest.approx(math.exp(OPTIMISM * guess.spread))
        and guess.spread < 2 * DEPARTURES["cuda"].noise
    )


def test_a_lever_never_measured_stays_uncertain(candidates):
    model = SpeedModel(candidates, "cuda")
    fp32 = [c for c in candidates if c.precision == "fp32"]
    fitted = model.fit([(c, measured(c)) for c in fp32])
    known = next(c for c in fp32 if c.micro_batch == 8 and not c.checkpointing and c.attention == "sdpa")
    unknown = replace(known, precision="bf16")
    assert fitted.guess(known).spread < 0.05
    assert fitted.guess(unknown).spread > 0.4  # the bf16 prior's spread (0.5) and its interactions
    # One probe of bf16 and its configs are known to within the interactions' spread.
    refitted = model.fit([(c, measured(c)) for c in fp32] + [(unknown, measured(unknown))])
    other = replace(unknown, micro_batch=4, grad_accum=2)
    assert refitted.guess(other).spread < 0.2
    assert refitted.guess(other).tokens_per_s == pytest.approx(true_speed(other), rel=0.1)


def test_noisy_measurements_count_for_less(candidates):
    model = SpeedModel(candidates, "cpu")
    c = candidates[0]
    steady = model.fit([(c, measured(c, spread=0.01))]).guess(replace(c, checkpointing=not c.checkpointing))
    noisy = model.fit([(c, measured(c, spread=0.3))]).guess(replace(c, checkpointing=not c.checkpointing))
    assert noisy.spread > steady.spread


def test_results_without_a_throughput_are_not_fitted(candidates):
    model = SpeedModel(candidates, "cuda")
    oom = ProbeResult(status="oom")
    assert model.fit([(candidates[0], oom)]).measured == 0


def test_each_strategy_is_a_lever_of_its_own():
    # Before: the model described a config without its strategy, so that fsdp-grad-op took the
    # average of ddp's and fsdp's measurements. Each strategy is a factor learnt from its probes.
    space = SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(4,),
        precisions=("bf16",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=8,
        gpus=2,
    )
    candidates = space.candidates()
    assert {c.strategy for c in candidates} == {"ddp", "fsdp", "fsdp-grad-op", "fsdp-offload"}
    by = {c.strategy: c for c in candidates}
    slower = {"ddp": 1.0, "fsdp": 3.0}  # measured on 2 CPU ranks over gloo: fsdp about 2.8x slower
    fitted = SpeedModel(candidates, "cpu").fit(
        [
            (
                by[s],
                ProbeResult(status="ok", tokens_per_s=10_000 / f, step_seconds=TOKENS * f / 10_000, step_spread=0.01),
            )
            for s, f in slower.items()
        ]
    )
    assert fitted.guess(by["fsdp"]).tokens_per_s == pytest.approx(10_000 / 3, rel=0.05)
    assert fitted.guess(by["ddp"]).tokens_per_s == pytest.approx(10_000, rel=0.05)
    # Unmeasured, fsdp-grad-op is not fsdp's twin: it may still be faster than what fsdp measured.
    grad_op = fitted.guess(by["fsdp-grad-op"])
    assert grad_op.optimistic_tokens_per_s > 10_000 / 3 * 1.5
