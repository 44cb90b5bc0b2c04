"""Every lever `autotune search` accepts is one `autotune plan` prices: each optimizer, PEFT method,
strategy, precision, weights dtype, attention kernel and speed lever, read from the same tables the
search's flags are checked against, gets a finite positive speed on a card that can run it (no
KeyError); and `plan --peft lora --gpus 2` predicts, as multi-GPU LoRA is searched."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from autotune.levers import sharding
from autotune.levers import speed_levers
from autotune.specs.cards import find_card
from autotune.levers.config import ATTENTIONS, PRECISIONS, ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.planner.card_speed import ModelDims, predict_speed, why_unsupported
from autotune.levers.recipes import OPTIMIZERS, PEFT_KINDS, WEIGHTS
from tests.helpers.cli import autotune
from tests.helpers.models import write_model_dir

LLAMA = ModelDims(6_738_415_616, layers=32, hidden=4096, vocab=32000, heads=32)
H100 = find_card("h100")
PEFTS = (None, *(f"{kind} r=16 alpha=32 dropout=0.05 targets=all-linear" for kind in PEFT_KINDS))


def _priced(**fields) -> float:
    config = ProbeConfig(**{"model": "m", "micro_batch": 4, "grad_accum": 2, "block_size": 1024, **fields})
    assert why_unsupported(config, H100) is None, fields
    prediction = predict_speed(config, LLAMA, H100)
    assert prediction is not None and math.isfinite(prediction.tokens_per_s) and prediction.tokens_per_s > 0, fields
    return prediction.tokens_per_s


@pytest.mark.parametrize("optimizer, peft", list(itertools.product(OPTIMIZERS, PEFTS)))
def test_every_optimizer_with_every_peft_method_is_priced(optimizer, peft):
    _priced(optimizer=optimizer, peft=peft, precision="bf16")


@pytest.mark.parametrize("strategy, peft", list(itertools.product(sharding.STRATEGIES, (None, PEFTS[1]))))
def test_every_strategy_on_two_gpus_is_priced_full_and_lora(strategy, peft):
    _priced(gpus=2, strategy=strategy, peft=peft, precision="bf16")


def _accepted(**fields) -> bool:
    """Whether a config of these levers is one the search's own checks accept."""
    try:
        ProbeConfig(**{"model": "m", "micro_batch": 4, "block_size": 1024, **fields})
    except BadInput:
        return False
    return True


@pytest.mark.parametrize(
    "precision, weights, attention",
    [
        combo
        for combo in itertools.product(PRECISIONS, WEIGHTS, ATTENTIONS)
        if _accepted(precision=combo[0], weights=combo[1], attention=combo[2])
    ],
)
def test_every_precision_weights_and_attention_kernel_is_priced(precision, weights, attention):
    _priced(precision=precision, weights=weights, attention=attention)


@pytest.mark.parametrize(
    "compile_, liger, allocator", list(itertools.product((False, True), (False, True), speed_levers.ALLOCATORS))
)
def test_every_speed_lever_is_priced(compile_, liger, allocator):
    _priced(compile=compile_, liger=liger, allocator=allocator, precision="bf16")


@pytest.mark.slow
def test_plan_of_lora_on_two_gpus_predicts(tmp_path, hermetic_home):
    model = write_model_dir(tmp_path / "tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    done = autotune(
        "plan",
        "--model",
        str(model),
        "--gpu",
        "a100",
        "--peft",
        "lora",
        "--gpus",
        "2",
        "--block-sizes",
        "64",
        "--micro-batches",
        "2",
        "--precisions",
        "bf16",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--strategies",
        "ddp,fsdp",
        "--optimizers",
        "adamw_torch",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    rows = plan["candidates"]
    assert len(rows) == 2 and all(r["fits"] for r in rows), rows
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # The speed error stated beside them is the published table's (benchmarks/published --speed).
    from autotune.planner import speed_error

    stated = speed_error.load()
    assert stated is not None and plan["speed_error"] == {
        "count": stated.count,
        "median": stated.median,
        "worst": stated.worst,
    }
