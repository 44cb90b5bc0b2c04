"""A pick that fits must fit the user's real, padded batches: the journey of issue 42 as a test.

A tiny BERT classifier on a CSV of texts of many lengths, searched with --dataset under a budget
between what a training step needs without the attention mask and with it: the probes carry the
mask of the worst padded batch (autotune.levers.tasks.padded_lengths), so the config whose masked step does
not fit is ruled out, and the pick trains under `autotune train` (each batch padded to its longest,
as the probes timed it) never above its probe's peak, and within 1% of it where every batch is the
worst, for eager attention (where the mask costs most) and sdpa; a Pegasus on JSONL pairs too.
Without the mask the probe of the largest config measured less than its run needs (it "fit")."""

from __future__ import annotations

import csv
import json
import random

import pytest

from autotune.levers.config import ProbeConfig
from autotune.probe import ProbeSettings
from autotune.search import SearchOptions, search
from autotune.vocabulary.status import RunEnd
from autotune.train import TrainOptions, train
from tests.helpers.tiny_tasks import write_tiny
from tests.helpers.corpus import corpus_text, write_task_tokenizer

pytestmark = pytest.mark.slow

MiB = 2**20
SETTINGS = ProbeSettings(device="cpu", measure_steps=1, margin=0)  # (the budget is what a step may allocate)
SPACE = {"micro_batches": (2, 4), "precisions": ("fp32",), "checkpointing": (False,), "effective_batch": 4}


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A tiny BERT classifier and a tiny Pegasus with tokenizers, a CSV of texts of 3 to 40 words
    and a JSONL of documents and summaries of many lengths."""
    root = tmp_path_factory.mktemp("padded")
    text = corpus_text()
    words = text.split()
    models = {family: write_tiny(root, family) for family in ("bert-classification", "pegasus")}
    for directory in models.values():
        write_task_tokenizer(text, directory)
    rng = random.Random(0)

    def passage(low: int, high: int) -> str:
        n = rng.randint(low, high)
        start = rng.randrange(len(words) - n)
        return " ".join(words[start : start + n])

    reviews = root / "reviews.csv"
    with reviews.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([passage(3, 40), rng.choice(["neg", "neutral", "pos"])] for _ in range(200))
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"document": passage(10, 80), "summary": passage(3, 20)}) + "\n" for _ in range(100))
    )
    return {"root": root, "models": models, "reviews": reviews, "pairs": pairs, "db": f"sqlite:///{root / 'padded.db'}"}


def step_peaks(model_dir, config: ProbeConfig) -> dict[bool, int]:
    """The peak allocated of two training steps of `config` as the probe runs them (its model, its
    optimizer, its batches), with the batches' attention mask and without: what the mask costs."""
    import torch

    from autotune.specs.models import resolve_model
    from autotune.probe.memory import CpuMemoryAccountant
    from autotune.probe.step import ProbeStep, build_random_model, make_optimizer

    cpu, peaks = torch.device("cpu"), {}
    for masked in (True, False):
        torch.manual_seed(0)
        with CpuMemoryAccountant() as accountant:
            model, hf_config = build_random_model(resolve_model(str(model_dir)), config, cpu, False)
            step = ProbeStep(model, make_optimizer(model, cpu, config.optimizer), config, cpu, hf_config.vocab_size)
            assert all("attention_mask" in batch for batch in step.batches)
            if not masked:
                step.batches = [{k: v for k, v in batch.items() if k != "attention_mask"} for batch in step.batches]
            step()
            step()
        peaks[masked] = accountant.peak_allocated
    return peaks


@pytest.fixture(scope="module")
def runner(probe_runner):
    return probe_runner(SETTINGS)


def searched(padded, runner, family: str, budget: int, study: str, **space):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        data = padded["reviews"] if family == "bert-classification" else padded["pairs"]
        from autotune.data.options import DataOptions

        return search(
            str(padded["models"][family]),
            budget,
            settings=SETTINGS,
            options=SearchOptions(study=study, predict=False, confirm=False),
            db=padded["db"],
            data=DataOptions(str(data)),
            runner=runner,
            **SPACE,
            **space,
        )


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_pick_of_a_padded_search_trains_under_its_budget(padded, runner, tmp_path, monkeypatch, attention):
    roomy = searched(padded, runner, "bert-classification", 256 * MiB, f"roomy-{attention}", attentions=(attention,))
    by_micro_batch = {row.config.micro_batch: row for row in roomy.leaderboard}
    largest = by_micro_batch[4]
    block = largest.config.block_size
    # The data's longest example, not the model's 256 positions: no batch of this data is longer.
    assert block < 256 and roomy.space.block_sizes == (block,)
    peaks = step_peaks(padded["models"]["bert-classification"], largest.config)
    mask_cost = peaks[True] - peaks[False]
    assert mask_cost > 0, peaks
    # A budget between the largest config's need without the mask and with it: an unmasked probe said
    # it fits, and its run (padded batches, with their mask) ran out of memory at step 1.
    budget = largest.peak_allocated_bytes - mask_cost // 2
    assert largest.peak_allocated_bytes - mask_cost < budget < largest.peak_allocated_bytes

    tight = searched(padded, runner, "bert-classification", budget, f"tight-{attention}", attentions=(attention,))
    statuses = {p.config.micro_batch: p.result.status for p in tight_probes(padded, f"tight-{attention}")}
    assert statuses[4] == "oom" and tight.best is not None and tight.best.config.micro_batch == 2, statuses

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The run pads each batch to its longest example, as the probes timed it (autotune.levers.lengths): its
    # peak is its worst batch's, which its first batches need not reach, and never more than the probe's.
    outcome = train(
        TrainOptions(dataset=str(padded["reviews"]), output_dir=str(tmp_path / "run"), max_steps=4, device="cpu"),
        study=f"tight-{attention}",
        db=padded["db"],
        echo=lambda line: None,
    )
    assert outcome.status == RunEnd.FINISHED, outcome.message
    assert tight.best.config.lengths is not None and outcome.summary.peak_vs_probe <= 1.01, outcome.summary
    # A run of the worst batch (the data's longest example beside a shorter one, whose padding puts
    # zeros in the mask: autotune.levers.tasks.padded_lengths) peaks at the probe's: four examples, two of
    # each length, two micro-batches of two each optimizer step (fewer rows than that and Trainer
    # steps without accumulating); Trainer's sampler is seeded, so the same batches every run.
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(padded["models"]["bert-classification"])
    with padded["reviews"].open() as f:
        longest = max((row[0] for row in list(csv.reader(f))[1:]), key=lambda text: len(tokens(text)["input_ids"]))
    assert len(tokens(longest)["input_ids"]) == tight.best.config.block_size
    worst = tmp_path / "worst.csv"
    with worst.open("w", newline="") as f:
        csv.writer(f).writerows(
            [
                ["text", "label"],
                [longest, "neg"],
                [longest[: len(longest) // 2], "pos"],
                [longest, "neutral"],
                [longest[: len(longest) // 2], "neg"],
            ]
        )
    outcome = train(
        TrainOptions(dataset=str(worst), output_dir=str(tmp_path / "worst"), max_steps=4, device="cpu"),
        study=f"tight-{attention}",
        db=padded["db"],
        echo=lambda line: None,
    )
    assert outcome.status == RunEnd.FINISHED, outcome.message
    assert 0.99 <= outcome.summary.peak_vs_probe <= 1.01, outcome.summary


def test_a_padded_seq2seq_pick_trains_at_its_probes_peak(padded, runner, tmp_path, monkeypatch):
    outcome = searched(padded, runner, "pegasus", 256 * MiB, "pegasus", attentions=("eager",), target_length=64)
    assert outcome.best is not None
    config = outcome.best.config
    assert config.block_size < 256 and config.target_length < 64  # both capped at the data's longest
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = train(
        TrainOptions(dataset=str(padded["pairs"]), output_dir=str(tmp_path / "run"), max_steps=4, device="cpu"),
        study="pegasus",
        db=padded["db"],
        echo=lambda line: None,
    )
    assert run.status == RunEnd.FINISHED, run.message
    assert 0.99 <= run.summary.peak_vs_probe <= 1.01, run.summary


def tight_probes(padded, study: str):
    from autotune.store import open_store

    with open_store(padded["db"]) as store:
        return store.probes(study)
