"""`autotune train` of a winner probed on two ranks: a real search over strategies on two CPU ranks
(gloo), then Trainer on two ranks started by torchrun, under the same cap per rank, each rank's
peak held against the probe's same rank. An fsdp winner on CPU is refused: accelerate shards with
FSDP on GPUs only."""

from __future__ import annotations

import json

import pytest

from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.status import RunEnd
from tests.helpers.corpus import corpus_text, write_pretrained_gpt2
from tests.helpers.models import TINY_GPT2
from tests.helpers.ranks import assert_rank_predicted

pytestmark = pytest.mark.slow

BUDGET = 64 * 2**20
# What the run trains on: the corpus's first characters, some 150 blocks of 64 tokens, many times
# the 16 sequences of its 4 steps on 2 ranks. (The whole corpus, 465,000 characters, took each rank
# a second and a half to tokenise and pack, for steps that read 16 blocks of it.)
TRAIN_CHARACTERS = 20_000


@pytest.fixture(scope="module")
def runner(probe_runner):
    from autotune.probe import ProbeSettings

    # One timed step, however short (no minimum window): what is asserted of these probes is their
    # peaks, reached in the warm-up, and that the search picked one.
    return probe_runner(ProbeSettings(device="cpu", measure_steps=1, measure_seconds=0.0))


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, runner):
    """A tiny GPT-2 with weights and a tokenizer, a corpus to train on, and a finished 2-rank study
    of the model on CPU."""
    from autotune.search import SearchOptions, search

    root = tmp_path_factory.mktemp("train-ranks")
    text = corpus_text()
    corpus = root / "corpus.txt"
    corpus.write_text(text[:TRAIN_CHARACTERS])
    model = write_pretrained_gpt2(text, root / "tiny-gpt2")  # (its tokenizer trained on the whole corpus)
    db = f"sqlite:///{root / 'ranks.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        outcome = search(
            str(model),
            BUDGET,
            settings=runner.settings,
            runner=runner,
            # (no confirmation round: tests/search/test_confirm.py; here it would time both again)
            options=SearchOptions(study="two-ranks", predict=False, confirm=False),
            db=db,
            micro_batches=(2,),
            block_sizes=(64,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=4,
            gpus=2,
            strategies=("ddp", "fsdp"),
        )
    assert outcome.best is not None, outcome
    return {"root": root, "model": model, "corpus": corpus, "db": db, "outcome": outcome, "runner": runner}


def _study_of_one_strategy(ranked, strategy: str) -> None:
    """A study named `strategy` whose one candidate is the fixture's config under that strategy (its
    probe reused from the fixture's study: the same config on the same machine)."""
    from autotune.search import SearchOptions, search

    runner = ranked["runner"]
    search(
        str(ranked["model"]),
        BUDGET,
        settings=runner.settings,
        runner=runner,
        options=SearchOptions(study=strategy, predict=False),
        db=ranked["db"],
        micro_batches=(2,),
        block_sizes=(64,),
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=4,
        gpus=2,
        strategies=(strategy,),
    )


def test_a_search_over_strategies_finishes_with_a_pick(ranked):
    outcome = ranked["outcome"]
    assert outcome.study.status == "finished", (
        outcome.stop_reason,
        [(c.label(), r.status, r.error) for c, r in outcome.unmeasured],
    )
    best = outcome.best.config
    assert (best.gpus, best.micro_batch, best.grad_accum) == (2, 2, 1)  # 2 ranks x 2 sequences = the effective batch 4
    assert best.strategy in ("ddp", "fsdp")
    assert len(outcome.best.rank_peaks) == 2


def test_each_strategys_ranks_hold_what_the_estimate_of_a_rank_predicts(ranked, trace_children):
    # (tests/estimate/test_ranks.py's gpt2 ddp and fsdp cases, asserted on this study's probes.)
    from autotune.estimate import estimate_memories
    from autotune.store import open_store

    with open_store(ranked["db"]) as store:
        probes = {p.config.strategy: p for p in store.probes("two-ranks") if p.result.status == "ok"}
    strategies = sorted(probes)
    assert strategies == ["ddp", "fsdp"], probes
    estimates = estimate_memories(
        [probes[s].config for s in strategies], device_type="cpu", use_cache=False, children=trace_children
    )
    width, vocabulary = TINY_GPT2["n_embd"], TINY_GPT2["vocab_size"]
    for strategy, estimate in zip(strategies, estimates):
        assert_rank_predicted(
            estimate, probes[strategy].result, largest_unit=vocabulary * width * 4 + 2 * width * 4, what=strategy
        )
    # Sharding holds half the parameters and optimizer state a rank of DDP holds.
    ddp, fsdp = estimates
    assert fsdp.params + fsdp.optimizer == pytest.approx((ddp.params + ddp.optimizer) / 2, rel=0.01)


def test_train_runs_the_ddp_winner_on_two_ranks_and_holds_each_ranks_peak_to_the_probes(ranked, tmp_path, monkeypatch):
    from autotune.train import TrainOptions, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    db = ranked["db"]
    _study_of_one_strategy(ranked, "ddp")  # (on CPU, Trainer can run ddp on ranks, not fsdp)
    # Run from another directory, the study's model as an older autotune stored it (as typed, relative
    # to where the search ran): --model says where it is, and every rank must be told it too.
    from sqlalchemy import create_engine, text

    with create_engine(db).begin() as connection:
        connection.execute(text("UPDATE autotune_studies SET model_reference = 'tiny-gpt2' WHERE name = 'ddp'"))
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    outcome = train(
        TrainOptions(dataset=str(ranked["corpus"]), output_dir="run", max_steps=4, device="cpu"),
        study="ddp",
        model=str(ranked["model"]),
        db=db,
        echo=lines.append,
    )
    assert outcome.status == RunEnd.FINISHED, outcome.message
    summary = outcome.summary
    assert summary.config.gpus == 2 and summary.config.strategy == "ddp"
    assert summary.steps == 4 and summary.final_loss is not None
    ranks = summary.ranks
    assert [rank.phase for rank in ranks] == ["rank 0", "rank 1"]
    for rank in ranks:
        assert rank.run_bytes and rank.probe_bytes
        # Trainer's DDP holds what the probe's held, real batches beside (measured: 6,983,680 bytes
        # against the probe's 6,978,560 on each rank).
        assert 0.99 < rank.ratio < 1.05, rank
    saved = json.loads((tmp_path / "run" / "autotune-run.json").read_text())
    assert saved["status"] == "finished" and len(saved["rank_peaks"]) == 2 and len(saved["probe"]["rank_peaks"]) == 2
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert any("on 2 ranks" in line for line in lines)


def test_an_fsdp_winner_on_cpu_is_refused_before_anything_runs(ranked, tmp_path, monkeypatch):
    from autotune.train import TrainOptions, train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    db = ranked["db"]
    _study_of_one_strategy(ranked, "fsdp")
    with pytest.raises(BadInput, match="shards with FSDP on GPUs only"):
        train(
            TrainOptions(dataset=str(ranked["corpus"]), output_dir=str(tmp_path / "run"), max_steps=2, device="cpu"),
            study="fsdp",
            db=db,
            echo=lambda line: None,
        )
    assert not (tmp_path / "run").exists()


def test_gpus_given_with_a_study_must_repeat_its_winners(ranked, tmp_path):
    from autotune.train import TrainOptions, train

    with pytest.raises(BadInput, match="--gpus 4 contradicts study 'two-ranks', whose winner was probed on 2 GPUs"):
        train(
            TrainOptions(dataset=str(ranked["corpus"]), output_dir=str(tmp_path / "run"), max_steps=2, device="cpu"),
            study="two-ranks",
            gpus=4,
            db=ranked["db"],
            echo=lambda line: None,
        )


def test_the_ranks_output_is_relayed_without_torchruns_own_report():
    import io

    from autotune.probe.torchrun import RanksOutput

    lines = [
        b"*****************************************\n",
        b"Setting OMP_NUM_THREADS environment variable for each process to be 1 in default\n",
        b"step 1/4: loss 6.9\n",
        b"autotune: rank 0: pass --model\n",
        b"E1126 14:54:09.763000 6119 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3)\n",
        b"Traceback (most recent call last):\n",
        b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
        b"Root Cause (first observed failure):\n",
    ]
    out = io.StringIO()
    relay = RanksOutput(io.BytesIO(b"".join(lines)), out)
    relay.run()
    assert out.getvalue() == "step 1/4: loss 6.9\nautotune: rank 0: pass --model\n"
