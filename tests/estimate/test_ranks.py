"""The estimate of one rank of a multi-GPU run (estimate/ranks.py, estimate/ledger.py) against
real 2-rank CPU probes (gloo), on a tiny GPT-2 (tied embeddings) and a tiny Llama (untied), LoRA
adapters under FSDP among them."""

from __future__ import annotations

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.estimate import estimate_memories, estimate_memory
from tests.helpers.models import write_model_dir
from tests.helpers.ranks import assert_rank_predicted

GiB = 2**30
LORA = "lora r=8 alpha=16 dropout=0.05 targets=all-linear"
# Probed here; the tiny Llama's ddp and fsdp are probed in tests/probe/test_ranks.py, and a tiny
# GPT-2's in tests/train/test_ranks.py (its study's probes), each beside the probes it makes.
CASES = [("llama", "fsdp-grad-op", None), ("gpt2", "fsdp", LORA)]
ESTIMATED = [*CASES, ("gpt2", "ddp", None), ("gpt2", "fsdp", None)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ranks")
    gpt2 = write_model_dir(root / "gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, '
        '"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, '
        '"max_position_embeddings": 256, "tie_word_embeddings": false}'
    )
    return {"gpt2": str(gpt2), "llama": str(llama)}


def cfg(model: str, strategy: str, gpus: int = 2, peft: str | None = None) -> ProbeConfig:
    return ProbeConfig(model=model, micro_batch=2, block_size=64, grad_accum=2, gpus=gpus, strategy=strategy, peft=peft)


@pytest.fixture(scope="module")
def estimates(models, trace_children) -> dict[tuple[str, str], object]:
    """Every case's estimate, and gpt2's ddp beside them, from one trace child."""
    keys = sorted(ESTIMATED, key=str)
    found = estimate_memories(
        [cfg(models[m], s, peft=p) for m, s, p in keys], device_type="cpu", use_cache=False, children=trace_children
    )
    return dict(zip(keys, found))


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy,peft", CASES)
def test_a_rank_is_predicted_to_the_byte(models, estimates, model, strategy, peft, probe_runner):
    from autotune.probe import ProbeSettings

    config = cfg(models[model], strategy, peft=peft)
    # (One timed step, however short: only the peaks are compared, and they are reached in the warm-up.)
    runner = probe_runner(ProbeSettings(device="cpu", warmup_steps=2, measure_steps=1, measure_seconds=0.0))
    probe = runner.run(config, runner.settings.budget(GiB))
    assert probe.status == "ok", probe.error
    assert_rank_predicted(
        estimates[(model, strategy, peft)], probe, largest_unit=1000 * 64 * 4 + 2 * 64 * 4, what=(model, strategy, peft)
    )


@pytest.mark.slow
def test_fsdp_holds_half_the_state_of_ddp_on_two_ranks(models, estimates):
    ddp, fsdp = estimates[("gpt2", "ddp", None)], estimates[("gpt2", "fsdp", None)]
    assert fsdp.params + fsdp.optimizer == pytest.approx((ddp.params + ddp.optimizer) / 2, rel=0.01)
    assert fsdp.peak_bytes < ddp.peak_bytes
    data = fsdp.to_dict()
    assert (data["gpus"], data["strategy"], data["per_rank"]) == (2, "fsdp", True)


@pytest.mark.slow
def test_uneven_shards_trace_the_last_rank_too(tmp_path, trace_children):
    # 3 ranks: a vocabulary of 1000 and 64-wide layers do not divide by 3.
    model = write_model_dir(tmp_path / "gpt2", n_layer=1, n_embd=64, n_head=2, vocab_size=1000, n_positions=128)
    estimate = estimate_memory(
        cfg(str(model), "fsdp", gpus=3), device_type="cpu", use_cache=False, children=trace_children
    )
    assert set(estimate.rank_peaks) == {"0", "2"}
    largest = max(estimate.rank_peaks.values(), key=lambda peaks: (peaks["reserved"], peaks["allocated"]))
    assert (estimate.peak_bytes, estimate.reserved_bytes) == (largest["allocated"], largest["reserved"])
    assert estimate.rank_peaks["0"]["allocated"] >= estimate.rank_peaks["2"]["allocated"]


def test_fsdp_offload_is_refused_for_a_cpu_prediction(models, monkeypatch):
    monkeypatch.setattr("autotune.estimate.predict.TraceChildren", None)  # no process may start
    with pytest.raises(BadInput, match="fsdp-offload"):
        estimate_memory(cfg(models["gpt2"], "fsdp-offload"), device_type="cpu", use_cache=False)


def test_replay_counts_a_storage_at_each_of_its_sizes():
    pytest.importorskip("torch")
    from autotune.estimate.ledger import _Storage, replay

    # A gathered parameter: born at 4096, freed in place (resize to 0), gathered again, then dead.
    gathered, other = _Storage(0, "forward"), _Storage(1000, "forward")
    events = [
        (1, gathered, "forward", 4096),
        (-1, gathered, "forward", 4096),
        (1, gathered, "forward", 0),
        (1, other, "forward", 1000),
        (-1, gathered, "backward", 0),
        (1, gathered, "backward", 4096),
        (-1, gathered, "", 4096),
    ]
    assert replay(events, cuda=False)["peak_bytes"] == 5096
    assert replay(events, cuda=True)["peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_ddp_rank_holds_the_same_on_two_four_and_eight_gpus(models, trace_children, device_type):
    # What lets `autotune plan --gpus 2,4,8` trace DDP once (estimate/predict.traced_as): each
    # world size traced for real here, bypassing that sharing, and compared to the byte. (FSDP's
    # shards shrink with the world: it is traced per count.)
    from autotune.estimate.predict import _trace_item, traced_as
    from autotune.estimate.protocol import TraceRequest
    from autotune.specs.models import resolve_model

    spec = resolve_model(models["llama"])
    configs = [
        ProbeConfig(model=models["llama"], micro_batch=1, block_size=64, grad_accum=16 // n, gpus=n, strategy="ddp")
        for n in (2, 4, 8)  # (accumulating on every count: a step without accumulation holds less)
    ]
    assert len({traced_as(c, device_type) for c in configs}) == 1
    results: dict[int, object] = {}
    request = TraceRequest(device_type, tuple(_trace_item(c, spec, False) for c in configs))
    trace_children.answer(request, 300.0, lambda result: results.__setitem__(result.index, result))
    figures = {
        configs[i].gpus: (r.peak_bytes, r.reserved_bytes, r.breakdown, r.phase_peaks) for i, r in results.items()
    }
    assert len(figures) == 3 and figures[2] == figures[4] == figures[8], figures
    fsdp = [
        traced_as(ProbeConfig(model=models["llama"], micro_batch=1, block_size=64, gpus=n, strategy="fsdp"), "cpu")
        for n in (2, 4)
    ]
    assert fsdp[0] != fsdp[1]
