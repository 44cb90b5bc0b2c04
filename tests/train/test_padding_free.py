"""Padding-free batches (issue 57): each micro-batch's examples end to end in one row, no padding,
each attending only to itself (TRL's padding_free, transformers' DataCollatorWithFlattening).

The lever keeps the math where the attention kernel keeps the examples apart by their position ids:
the same examples train to the same loss and gradients as a padded batch of them (SDPA and eager,
transformers 5's block-diagonal mask), which each probe checks on its model before timing; a model
whose attention mixes them (one that builds a KV cache in training, whose mask ignores the
positions) is skipped with the reason. A search of a causal LM trained per example chooses between
padded and padding-free batches by real tokens/s, and `autotune train` runs the padding-free pick
with DataCollatorWithFlattening, never above its probe's peak."""

from __future__ import annotations

import json
import random

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from tests.helpers.lengths import BLOCK, DATA, TEXT

MiB = 2**20


def config(micro_batch: int = 4, **changes) -> ProbeConfig:
    fields = dict(
        model="gpt2",
        micro_batch=micro_batch,
        block_size=BLOCK,
        grad_accum=8 // micro_batch,
        lengths=TEXT,
        padding_free=True,
    )
    return ProbeConfig(**{**fields, **changes})


def test_a_padding_free_config_computes_only_real_tokens_and_is_another_config():
    padded, flat = config(padding_free=False), config()
    assert flat.tokens_per_step == padded.tokens_per_step  # the same examples...
    assert flat.padded_tokens_per_step == flat.tokens_per_step < padded.padded_tokens_per_step  # ...none padded
    assert flat.padding_share == 0.0 and flat.padded_per_real == 1.0 and padded.padding_share > 0.2
    assert flat.key() != padded.key() and flat.label().endswith(" padding-free")
    assert ProbeConfig.from_dict(flat.to_dict()) == flat
    for changes in ({"lengths": None}, {"task": "classification", "num_labels": 2}):
        with pytest.raises(BadInput, match="--padding-free on puts each micro-batch's examples end to end"):
            config(**changes)


def batches(attention: str, rows: list[int]):
    """A tiny GPT-2 (no KV cache in training, as every probe and hand-off builds it) and the same
    examples as a padded batch and as a padding-free one."""
    import torch
    import transformers

    from autotune.probe.batches import drawn_batch

    torch.manual_seed(0)
    hf = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=96,
        n_positions=BLOCK,
        use_cache=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )  # (no dropout: the two compare)
    model = transformers.GPT2LMHeadModel._from_config(hf, attn_implementation=attention)
    flat = drawn_batch(config(len(rows), attention=attention), rows, 96, torch.device("cpu"))
    assert set(flat) == {"input_ids", "position_ids", "labels"} and flat["input_ids"].shape == (1, sum(rows))
    padded_config = config(len(rows), attention=attention, padding_free=False)
    padded = drawn_batch(padded_config, rows, 96, torch.device("cpu"))
    start = 0
    for row, length in enumerate(rows):  # (the same tokens: the flat row's, cut back into rows)
        padded["input_ids"][row, :length] = flat["input_ids"][0, start : start + length]
        start += length
    padded["labels"] = torch.where(padded["attention_mask"].bool(), padded["input_ids"], -100)
    return model, padded, flat


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_free_batches_train_what_padded_ones_do(attention):
    import torch

    from autotune.probe.batches import keeps_examples_apart

    model, padded, flat = batches(attention, [7, 31, 2, 13])
    assert keeps_examples_apart(model, 96, torch.device("cpu"))
    grads = []
    for batch in (padded, flat):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_padded, grads_padded), (loss_flat, grads_flat) = grads
    assert torch.allclose(loss_padded, loss_flat, rtol=1e-5), (loss_padded, loss_flat)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads_padded, grads_flat))


def test_a_model_whose_attention_mixes_the_examples_is_found_out():
    import torch

    from autotune.probe.batches import padding_free_problem

    model, padded, flat = batches("sdpa", [9, 9])
    model.config.use_cache = True  # a cache in training: transformers then ignores the positions' boundaries
    assert "does not keep examples put end to end apart" in padding_free_problem(
        model, config(2), 96, torch.device("cpu")
    )
    with torch.no_grad():
        assert not torch.allclose(model(**padded, use_cache=False).loss, model(**flat).loss, rtol=1e-4)
    model.config.use_cache = False
    assert padding_free_problem(model, config(2), 96, torch.device("cpu")) is None


def test_trls_loss_takes_a_padding_free_batch():
    import torch

    from autotune.probe.step import TrlLoss

    model, padded, flat = batches("sdpa", [5, 20, 11])
    losses = [TrlLoss(model)(model, batch, reads_values=True) for batch in (padded, flat)]
    assert torch.allclose(losses[0], losses[1], rtol=1e-5), losses


def test_the_space_offers_padding_free_only_where_it_keeps_the_examples_and_trl_can_run_it(tmp_path):
    from autotune.specs.models import resolve_model
    from autotune.search.space import SearchSpace
    from autotune.levers.tasks import DataShape
    from tests.helpers.models import write_model_dir

    gpt2 = resolve_model(str(write_model_dir(tmp_path / "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)))
    shape = DataShape("sft.jsonl", "causal-lm", 4000, longest=max(DATA), lengths=TEXT)
    space = SearchSpace.build(
        gpt2,
        effective_batch=8,
        block_sizes=(256,),
        packing=False,
        data_shape=shape,
        micro_batches=(2, 8),
        samplings=("random", "group_by_length"),
        padding_frees=(False, True),
    )
    assert {(c.micro_batch, c.sampling, c.padding_free) for c in space.candidates()} == {
        (m, s, False) for m in (2, 8) for s in ("random", "group_by_length")
    } | {(2, "random", True), (8, "random", True)}
    assert space.to_dict()["padding_frees"] == [False, True] and SearchSpace.from_stored(space.to_dict()) == space
    with pytest.raises(BadInput, match="--padding-free on puts each micro-batch's examples end to end"):
        SearchSpace.build(gpt2, effective_batch=8, padding_frees=(True,))
    # TRL cuts no example under padding_free: data longer than the block is refused for it.
    with pytest.raises(BadInput, match=r"TRL does not cut examples under padding_free .* up to 128 tokens"):
        SearchSpace.build(
            gpt2,
            effective_batch=8,
            block_sizes=(64,),
            packing=False,
            data_shape=shape,
            trainer="trl",
            padding_frees=(True,),
        )


def test_each_tool_is_handed_padding_free_batches_or_refuses_them():
    from autotune.handoff.lightning import lightning_notes
    from autotune.handoff.scripts import cli_caveats
    from autotune.handoff.tools import axolotl_document, llamafactory_document, trl_document
    from tests.helpers.store import best_of

    best = best_of(config(4, trainer="trl"))
    document = trl_document(best)
    assert (document["padding_free"], document["max_length"], document["packing"]) == (True, None, False)
    for write, key in ((axolotl_document, "sample_packing"), (llamafactory_document, "neat_packing")):
        with pytest.raises(BadInput, match=f"padding-free.*only with {key}"):
            write(best)
    assert any("DataCollatorWithFlattening" in note for note in lightning_notes(best))
    assert any("packs examples into blocks" in caveat for caveat in cli_caveats(best))
    assert "data_collator=best.data_collator(tokenizer))  # examples end to end" in str(best_of(config(4)))
    cut = best_of(config(4, trainer="trl", block_size=64))  # (the data's longest examples are above 64)
    with pytest.raises(BadInput, match="cut them to 64 first"):
        trl_document(cut)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tiny GPT-2 with a tokenizer, and a JSONL of 300 texts of long-tailed lengths."""
    from tests.helpers.corpus import corpus_text, write_task_tokenizer
    from tests.helpers.models import write_model_dir

    root = tmp_path_factory.mktemp("padding-free")
    text = corpus_text()
    words = text.split()
    model = write_model_dir(root / "gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=BLOCK)
    write_task_tokenizer(text, model, mask=False)
    rng = random.Random(1)
    data = root / "sft.jsonl"
    with data.open("w") as f:
        for length in rng.sample(DATA, 300):
            start = rng.randrange(len(words) - length)
            f.write(json.dumps({"text": " ".join(words[start : start + length])}) + "\n")
    return {"model": model, "data": data, "db": f"sqlite:///{root / 'padding-free.db'}"}


@pytest.mark.slow
def test_a_search_chooses_padding_free_batches_by_real_tokens_and_its_run_fits(
    sft, probe_runner, tmp_path, monkeypatch
):
    from autotune.data.options import DataOptions
    from autotune.probe import ProbeSettings
    from autotune.search import SearchOptions, search
    from autotune.vocabulary.status import RunEnd
    from autotune.train import TrainOptions, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = ProbeSettings(device="cpu", measure_steps=2, margin=0)
    outcome = search(
        str(sft["model"]),
        512 * MiB,
        settings=settings,
        db=sft["db"],
        options=SearchOptions(study="flat", predict=False, confirm=False),
        data=DataOptions(str(sft["data"])),
        runner=probe_runner(settings),
        packing=False,
        padding_frees=(False, True),
        micro_batches=(4,),
        effective_batch=8,
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
    )
    rows = {row.config.padding_free: row for row in outcome.leaderboard}
    assert set(rows) == {False, True} and all(row.tokens_per_s for row in rows.values())
    assert rows[True].config.padding_share == 0.0 < rows[False].config.padding_share
    assert rows[True].config.tokens_per_step == rows[False].config.tokens_per_step
    # The padding-free pick trains under Trainer with DataCollatorWithFlattening, at most its probe's peak.
    only = search(
        str(sft["model"]),
        512 * MiB,
        settings=settings,
        db=sft["db"],
        options=SearchOptions(study="flat-only", predict=False, confirm=False),
        data=DataOptions(str(sft["data"])),
        runner=probe_runner(settings),
        packing=False,
        padding_frees=(True,),
        micro_batches=(4,),
        effective_batch=8,
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
    )
    assert only.best is not None and only.best.config.padding_free
    run = train(
        TrainOptions(dataset=str(sft["data"]), output_dir=str(tmp_path / "run"), max_steps=4, device="cpu"),
        study="flat-only",
        db=sft["db"],
        echo=lambda line: None,
    )
    assert run.status == RunEnd.FINISHED, run.message
    assert run.summary.peak_vs_probe <= 1.01, run.summary


@pytest.mark.slow
def test_the_estimate_of_a_padding_free_step_is_the_cpu_probes_peak(sft, probe_runner, trace_children):
    """The estimator traces the probe's padding-free worst batch (one row of micro-batch x block tokens)
    with transformers' block-diagonal mask, as the real run makes it: to the byte on the CPU."""
    from autotune.estimate import estimate_memories
    from autotune.probe import ProbeSettings

    # (checkpointing keeps the mask, an input of every checkpointed layer, alive through the backward:
    # 1 MiB of it at 8 x 128 positions, which an estimate without it would miss)
    configs = [
        config(8, model=str(sft["model"]), attention=attention, grad_accum=1, checkpointing=True)
        for attention in ("sdpa", "eager")
    ]
    estimates = estimate_memories(configs, device_type="cpu", use_cache=False, children=trace_children)
    runner = probe_runner(ProbeSettings(device="cpu", warmup_steps=2, measure_steps=1, measure_seconds=0.0))
    for config_, estimate in zip(configs, estimates):
        probe = runner.run(config_, runner.settings.budget(2 * 2**30))
        assert probe.status == "ok", probe.error
        assert (estimate.peak_bytes, estimate.reserved_bytes) == (probe.peak_allocated_bytes, probe.peak_reserved_bytes)


def test_trls_padding_free_batch_is_its_collators():
    """The probe's padding-free batch for --trainer trl is what TRL's own collator makes of the same
    examples (the keys, the boundaries, the labels' -100 at each example's start)."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from autotune.probe.batches import drawn_batch

    rows = [5, 9, 3]
    ours = drawn_batch(config(3, trainer="trl"), rows, 96, torch.device("cpu"))
    examples, start = [], 0
    for n in rows:
        examples.append({"input_ids": ours["input_ids"][0, start : start + n].tolist()})
        start += n
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    assert set(ours) == set(theirs), (set(ours), set(theirs))
    for key, value in theirs.items():
        assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(value)), key


def test_plan_prices_padding_free_and_grouped_batches_from_the_lengths_alone():
    """`plan --dataset` for a card: padded rows at their expected padded length, padding-free rows at
    the mean with the attention over the whole row outside a flash kernel, grouped rows as the
    sampler groups them (a grouped config could not be priced before: its plain twin kept the
    sampler and lost the lengths)."""
    from autotune.specs.cards import find_card
    from autotune.levers.lengths import Lengths
    from autotune.planner.card_speed import ModelDims, predict_step_seconds

    # (an 8B model: GPT-2 at these sizes keeps an H100 waiting on kernel launches, positions or not)
    llama = ModelDims(
        8_029_995_008,
        layers=32,
        hidden=4096,
        vocab=128256,
        heads=32,
        intermediate=14336,
        kv_width=1024,
        gated=True,
        model_type="llama",
        rms_norm=True,
    )
    h100 = find_card("h100")

    # (examples 16 times the test data's, cut at 2,048: at a few hundred tokens a micro-step an H100
    # is bound by launching kernels, and positions cost nothing measurable)
    longer = Lengths.of([16 * n for n in DATA]).to_text()

    def speed(**changes) -> float:
        fields = {"precision": "bf16", "block_size": 2048, "lengths": longer, **changes}
        return predict_step_seconds(config(8, **fields), llama, h100).tokens_per_s

    padded, grouped = speed(padding_free=False), speed(padding_free=False, sampling="group_by_length")
    flat_flash, flat_sdpa = speed(attention="flash_attention_2"), speed()
    # The same real tokens per step: the fewer positions computed, the faster.
    assert padded < grouped < flat_sdpa < flat_flash, (padded, grouped, flat_sdpa, flat_flash)
    assert flat_flash / padded > 2  # (60% of mb8's padded positions are padding on this data)


def test_the_speed_models_fill_tells_padded_rows_from_padding_free_ones():
    """A micro-step's fill counts the positions it computes: padded rows of a micro-batch hold more
    than padding-free rows of the same micro-batch, so their fills differ (one key held both)."""
    from autotune.search.speed_model import SpeedModel

    model = SpeedModel([config(m, padding_free=flat) for m in (2, 8) for flat in (False, True)], "cuda")
    fill = model.index["micro_batch_fill"]
    padded, flat = (model.row(config(2, padding_free=value))[fill] for value in (False, True))
    assert padded != flat, (padded, flat)
    assert (
        model.tokens_per_sequence[(BLOCK, 8, "random", True)] < model.tokens_per_sequence[(BLOCK, 8, "random", False)]
    )


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--padding-free", "maybe"], "--padding-free: unknown value 'maybe'"),
        (["--padding-free", "on"], "--padding-free on puts each micro-batch's examples end to end"),
        (["--padding-free", "on", "--packing", "on"], "--padding-free on puts each micro-batch's examples end to end"),
    ],
)
def test_a_wrong_padding_free_flag_is_one_line_and_writes_nothing(tmp_path, flags, said):
    from tests.helpers.cli import Unchanged, invoke, refused
    from tests.helpers.models import write_model_dir

    model = write_model_dir(tmp_path / "gpt2")
    with Unchanged(tmp_path):
        outcome = invoke(
            "search",
            "--model",
            str(model),
            "--gpu-budget",
            "1GiB",
            "--device",
            "cpu",
            *flags,
            "--db",
            f"sqlite:///{tmp_path / 'never.db'}",
        )
    refused(outcome, said)


def test_the_check_holds_in_bf16_where_two_shapes_round_apart():
    """A bf16 model's logits of one example alone and behind another round differently (16 bits): the
    check still passes where the attention keeps them apart, and still finds the mixing one out."""
    import torch
    import transformers

    from autotune.probe.batches import keeps_examples_apart

    for cache, apart in ((False, True), (True, False)):
        torch.manual_seed(0)
        hf = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=BLOCK, use_cache=cache)
        model = transformers.GPT2LMHeadModel._from_config(hf, attn_implementation="sdpa", dtype=torch.bfloat16)
        assert keeps_examples_apart(model, 96, torch.device("cpu")) is apart
