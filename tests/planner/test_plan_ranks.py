"""`plan --gpus N`: each strategy's per-rank need and the whole run's speed."""

from __future__ import annotations

import pytest

from autotune.specs.cards import find_card
from autotune.specs.models import resolve_model
from autotune.planner import Target, make_plan
from autotune.render.plan_table import render_plan
from autotune.search.space import SearchSpace
from tests.helpers.models import write_model_dir


@pytest.mark.slow
def test_a_plan_on_two_gpus_gives_each_strategy_its_rank_and_speed(tmp_path):
    model = str(write_model_dir(tmp_path / "gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128))
    spec = resolve_model(model)
    space = SearchSpace.build(
        spec,
        micro_batches=(2,),
        block_sizes=(64,),
        precisions=("bf16",),
        checkpointing=(False,),
        attentions=("sdpa",),
        gpus=2,
        strategies=("ddp", "fsdp", "fsdp-offload"),
    )
    card = find_card("h100")
    plan = make_plan(spec, space, Target.of(card, None, 0.05), timeout=300, use_cache=False)
    by_strategy = {p.config.strategy: p for p in plan.planned}
    assert set(by_strategy) == {"ddp", "fsdp", "fsdp-offload"}
    for item in plan.planned:
        assert item.fits and item.tokens_per_s and item.estimate is not None and item.estimate.per_rank
        assert item.to_dict()["per_rank"] and item.to_dict()["gpus"] == 2
    ddp, fsdp, offload = (by_strategy[s].estimate for s in ("ddp", "fsdp", "fsdp-offload"))
    assert fsdp.params + fsdp.optimizer == pytest.approx((ddp.params + ddp.optimizer) / 2, rel=0.05)
    assert offload.optimizer == 0 and offload.params < fsdp.params  # on the host: not the card's
    assert by_strategy["fsdp"].speed.comm_seconds >= 0 and by_strategy["ddp"].speed.gpus == 2
    assert "need/rank" in render_plan(plan)
