"""`autotune plan`: the space predicted without a GPU. On CPU the prediction must equal what the
real CPU probes measure, config by config; between a group's traced ends, the interpolation must
stay within 1% of a real trace."""

from __future__ import annotations

import json

import pytest

from autotune.specs.cards import find_card
from autotune.levers.config import ProbeConfig
from autotune.levers.recipes import peft_text
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import resolve_model
from autotune.planner import Target, make_plan, unplannable
from autotune.render.plan_table import render_plan
from tests.helpers.fakes import fake_estimate, request
from autotune.search.space import SearchSpace

MiB = 2**20
GiB = 2**30


def test_a_budget_above_the_card_and_a_cpu_without_budget_are_one_line_mistakes():
    with pytest.raises(BadInput, match=r"--gpu-budget 30\.00 GiB is more than the .*4090.*memory \(23\.64 GiB\)"):
        Target.of(find_card("rtx4090"), 30 * GiB, 0.05)
    with pytest.raises(BadInput, match="--gpu cpu needs --gpu-budget"):
        Target.of(None, None, 0.05, cpu=True)
    target = Target.of(find_card("h100"), None, 0.05)
    assert target.budget.total_bytes == find_card("h100").memory_bytes
    assert target.budget.margin_bytes == int(0.05 * target.budget.total_bytes)


@pytest.mark.parametrize(
    "levers, card, reason",
    [
        ({"precision": "bf16"}, "t4", "bf16: not on the"),
        ({"precision": "tf32"}, "v100", "tf32: not on the"),
        ({"attention": "flash_attention_2", "precision": "fp16"}, "t4", "flash_attention_2: not on the"),
        ({"liger": True}, "h100", "cannot trace Liger"),
        ({"optimizer": "paged_adamw_8bit"}, "h100", "CUDA unified memory"),
        ({"optimizer": "adamw_8bit", "peft": peft_text("qlora")}, "h100", None),
        ({"precision": "bf16"}, "h100", None),
    ],
)
def test_what_a_card_lacks_or_the_estimator_cannot_trace_is_said_not_predicted(levers, card, reason):
    config = ProbeConfig("gpt2", 2, 64, **levers)
    why = unplannable(config, Target.of(find_card(card), None, 0.05))
    assert (why is None) if reason is None else (reason in why)


@pytest.mark.slow
def test_on_cpu_the_plan_equals_every_real_probe_and_interpolates_within_one_percent(
    tiny_model, tmp_path, probe_runner, trace_children
):
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, run_search
    from autotune.store import open_store

    spec = resolve_model(tiny_model)
    # Effective batch 16: micro-batches 1, 2, 4, 8 accumulate (one group of four: 1, 4 and 8 are
    # traced, 2 is interpolated), 16 does not (a group of its own); with and without checkpointing.
    space = SearchSpace.build(
        spec,
        micro_batches=(1, 2, 4, 8, 16),
        block_sizes=(64,),
        precisions=("fp32",),
        checkpointing=(False, True),
        attentions=("sdpa",),
        effective_batch=16,
    )
    budget = 1 * GiB
    db = f"sqlite:///{tmp_path / 'plan.db'}"
    with open_store(db) as store:
        runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1, measure_seconds=0.0))
        run_search(
            request(
                space,
                spec,
                budget,
                50 * MiB,
                SearchOptions(study="measured", predict=False, confirm=False, strategy="grid-full"),
            ),
            runner,
            store,
        )
        target = Target.of(None, budget, 50 * MiB, cpu=True)
        plan = make_plan(spec, space, target, timeout=120, children=trace_children, store=store)
        exact = make_plan(spec, space, target, exact=True, timeout=120, children=trace_children)

    assert plan.study == "measured"  # found by model, space and device kind
    assert len(plan.planned) == 10 and all(p.measured and p.measured["status"] == "ok" for p in plan.planned)
    interpolated = [p for p in plan.planned if not p.traced]
    assert [p.config.micro_batch for p in interpolated] == [2, 2]
    for item in plan.planned:
        if item.traced:  # a trace predicts what the CPU probe accounts, to the byte
            assert item.need_bytes == item.measured["need_bytes"], item.config.label()
            assert item.measured["need_error"] == 0
    traced = {p.config.key(): p for p in exact.planned}
    for item in interpolated:
        real = traced[item.config.key()].need_bytes
        # Never under what a trace says (the need is convex in the micro-batch); on a model this
        # small, 96 KiB of rounding is 2% (see the next test for a model of some size).
        assert real <= item.need_bytes < 1.03 * real, (item.config.label(), item.need_bytes, real)
        assert 0 <= item.measured["need_error"] < 0.03
    # A search of the same space afterwards predicts from the plan's traces: each group's traced
    # members are those the search traces, and all are in the cache (no trace process starts).
    from autotune.estimate import estimate_memories
    from autotune.search.predictions import predict

    predictions = predict(space.candidates(), "cpu")
    assert {key: p.required_bytes for key, p in predictions.items()} == {
        p.config.key(): p.need_bytes for p in plan.planned
    }
    assert all(e.cached for e in estimate_memories([p.config for p in plan.planned if p.traced], device_type="cpu"))
    text = render_plan(plan)
    assert "all figures predicted" in text and "measured beside them from study 'measured'" in text
    document = json.loads(json.dumps(plan.to_dict()))
    assert document["device_type"] == "cpu" and all(c["predicted"] for c in document["candidates"])


@pytest.mark.slow
def test_interpolation_stays_within_one_percent_of_a_real_trace_on_a_card(tmp_path, trace_children):
    """A GPT-2 of some size (4 layers of 256, a vocabulary of 8192) predicted for an H100: every
    interpolated need against the trace of the same config."""
    from tests.helpers.models import write_model_dir

    model = str(
        write_model_dir(tmp_path / "gpt2-small-ish", n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256)
    )
    spec = resolve_model(model)
    space = SearchSpace.build(
        spec,
        micro_batches=(1, 2, 4, 8, 16),
        block_sizes=(128,),
        precisions=("bf16", "fp16"),
        checkpointing=(False, True),
        attentions=("sdpa",),
        effective_batch=16,
    )
    target = Target.of(find_card("h100"), None, 0.05)
    exact = {
        p.config.key(): p
        for p in make_plan(spec, space, target, exact=True, timeout=120, children=trace_children).planned
    }
    plan = make_plan(spec, space, target, timeout=120, children=trace_children)
    # fp16 is traced as bf16 on CUDA, and the second plan reads the first's traces from the cache:
    # each estimate is still its own config's.
    assert all(p.estimate is not None and p.estimate.config == p.config for p in plan.planned)
    interpolated = [p for p in plan.planned if not p.traced]
    assert len(interpolated) == 4  # micro-batch 2 of each accumulating group
    for item in interpolated:
        real = exact[item.config.key()].need_bytes
        assert real <= item.need_bytes < 1.01 * real, (item.config.label(), item.need_bytes, real)
    assert plan.best is not None and plan.best.tokens_per_s > 0  # ranked by the cost model


def test_a_lever_the_card_lacks_is_said_once_not_drawn_as_rows_of_dashes():
    """`plan --gpu t4 --precisions fp32,bf16`: the T4 has no bf16, so its configs are no rows (they used to
    be rows of dashes); the footer says how many and why."""
    from autotune.planner import Plan, Planned

    space = SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(2, 4),
        block_sizes=(512,),
        precisions=("fp32", "bf16"),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=4,
    )
    target = Target.of(find_card("t4"), None, 0.05)
    planned = []
    for config in space.candidates():
        item = Planned(config, why_not=unplannable(config, target))
        if item.why_not is None:
            item.estimate, item.fits = fake_estimate(config, config.micro_batch * GiB), True
        planned.append(item)
    text = render_plan(Plan("gpt2", target, space, sorted(planned, key=lambda p: p.estimate is None)))
    rows = [line for line in text.splitlines() if line[:3].strip().isdigit()]
    assert [row.split()[1] for row in rows] == ["mb2x2", "mb4x1"] and not any("bf16" in row for row in rows)
    assert "2 not predicted, not shown: bf16: not on the NVIDIA Tesla T4" in text
    assert text.startswith("plan: 4 candidates on NVIDIA Tesla T4, budget 14.75 GiB (margin")
    # Another reason beside it: each with its count.
    planned[-1].why_not = "cannot trace Liger's kernels"
    text = render_plan(Plan("gpt2", target, space, planned))
    assert "2 not predicted, not shown: bf16: not on the NVIDIA Tesla T4 (1); cannot trace Liger's kernels (1)" in text


def test_a_budget_typed_in_decimal_units_is_shown_as_typed_and_as_read():
    from autotune.planner import Plan
    from autotune.vocabulary.units import size_as_read

    assert size_as_read(16 * 10**9) == "16GB = 14.90 GiB" and size_as_read(500 * 10**6) == "500MB = 476.84 MiB"
    assert size_as_read(int(7.5 * 10**9)) == "7.5GB = 6.98 GiB"
    assert size_as_read(8 * GiB) == "8.00 GiB" and size_as_read(8192 * MiB) == "8.00 GiB"  # binary: as it is
    assert size_as_read(find_card("t4").memory_bytes) == "14.75 GiB"  # a card's total: binary
    space = SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(2,),
        block_sizes=(512,),
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=2,
    )
    text = render_plan(Plan("gpt2", Target.of(find_card("rtx4080"), 16 * 10**9, 0.05), space, []))
    assert text.startswith("plan: 0 candidates on NVIDIA GeForce RTX 4080, budget 16GB = 14.90 GiB (margin 762.94 MiB)")


def test_a_plan_for_an_older_stack_traces_with_it_and_says_so(monkeypatch):
    from autotune.estimate.stack import Stack
    from autotune.specs.models import resolve_model
    from autotune.planner import card_plan as planner_plan
    from autotune.planner.card_plan import Target, make_plan
    from autotune.search.space import SearchSpace

    asked = {}

    def no_traces(space, targets, **kwargs):
        asked.update(kwargs)
        return planner_plan.Traced({}, frozenset(), 0)

    monkeypatch.setattr(planner_plan, "trace_space", no_traces)
    spec = resolve_model("gpt2")
    plan = make_plan(
        spec,
        SearchSpace.build(spec, precisions=("fp32",)),
        Target.of(None, 8 * 2**30, 0),
        timeout=60,
        stack=Stack(torch="1.13"),
    )
    assert asked["stack"] == Stack(torch="1.13")
    assert plan.notes == ["predicted for torch 1.13: gradients zeroed in place, kept between steps (before 2.0)"]
