"""A probe covers the run's phases: its training steps, then evaluation and generation as Trainer
runs them, each phase's peak its own. Real probes of tiny models on CPU, in one warm child."""

from __future__ import annotations

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.levers.evaluation import recipe_fields
from autotune.probe import ProbeSettings
from autotune.render.tables import format_probe_result
from tests.helpers.models import write_model_dir
from tests.helpers.tiny_tasks import write_tiny

MiB = 2**20
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner(probe_runner):
    return probe_runner(ProbeSettings(device="cpu", measure_steps=2))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "gpt2": str(write_model_dir(root / "tiny-gpt2")),
        **{family: str(write_tiny(root, family)) for family in ("pegasus", "bert-classification")},
    }


def gpt2(model: str, **evaluation) -> ProbeConfig:
    return ProbeConfig(model=model, micro_batch=2, block_size=128, **evaluation)


def test_kept_logits_that_do_not_fit_beside_the_training_state_fail_the_eval_phase(runner, models):
    tiny_model_dir = models["gpt2"]
    # 4 eval batches of 8 x 128 x 1024 fp32 logits kept on the card (4 MiB each, concatenated):
    # the training steps fit in 20 MiB, the evaluation does not.
    budget = runner.settings.budget(20 * MiB)
    kept = runner.run(gpt2(tiny_model_dir, eval_batch=8, eval_logits="kept", eval_accumulation_steps=4), budget)
    assert kept.status == "oom" and kept.failed_phase == "eval" and kept.error.startswith("eval phase: ")
    assert kept.tokens_per_s is not None  # the training steps were measured before
    train_only = runner.run(gpt2(tiny_model_dir), budget)
    assert train_only.status == "ok" and train_only.phase_peaks is None
    assert kept.phase_peaks["train"] == {
        "allocated": train_only.peak_allocated_bytes,
        "reserved": train_only.peak_reserved_bytes,
    }
    # The same evaluation keeping only the loss fits, and its phase is recorded beside training's.
    loss_only = runner.run(gpt2(tiny_model_dir, eval_batch=8), budget)
    assert loss_only.status == "ok" and loss_only.failed_phase is None
    assert set(loss_only.phase_peaks) == {"train", "eval"}
    assert loss_only.peak_reserved_bytes == max(p["reserved"] for p in loss_only.phase_peaks.values())
    assert "phases  peak reserved: train" in format_probe_result(
        loss_only_config := gpt2(tiny_model_dir, eval_batch=8), loss_only
    )
    assert "eval8" in loss_only_config.label()
    # Kept logits pile up: 4 batches need more than the loss alone, with room to hold them.
    roomy = runner.run(
        gpt2(tiny_model_dir, eval_batch=8, eval_logits="kept", eval_accumulation_steps=4),
        runner.settings.budget(64 * MiB),
    )
    assert roomy.status == "ok"
    assert roomy.phase_peaks["eval"]["allocated"] - loss_only.phase_peaks["eval"]["allocated"] >= 3 * 4 * MiB


def test_beam_search_that_does_not_fit_fails_the_generate_phase_and_greedy_fits(runner, models):
    seq2seq = dict(
        model=models["pegasus"],
        micro_batch=2,
        block_size=128,
        task="seq2seq",
        target_length=32,
        eval_batch=4,
        generation_max_length=128,
    )
    budget = runner.settings.budget(10 * MiB)
    beams = runner.run(ProbeConfig(**seq2seq, generation_num_beams=8), budget)
    assert beams.status == "oom" and beams.failed_phase == "generate", beams.error
    assert set(beams.phase_peaks) == {"train", "eval", "generate"}
    greedy = runner.run(ProbeConfig(**seq2seq, generation_num_beams=1), budget)
    assert greedy.status == "ok", greedy.error
    assert greedy.phase_peaks["train"] == beams.phase_peaks["train"]
    # 8 beams keep 8 times the KV cache and scores of one: more memory than greedy decoding.
    assert greedy.phase_peaks["generate"]["reserved"] < beams.phase_peaks["generate"]["reserved"]


def test_a_classifiers_kept_logits_are_small_and_one_child_runs_every_phase(runner, models):
    # (The runner is the test worker's, shared with the modules it ran before this one.)
    started, retired = runner.children_started, list(runner.retired)
    config = ProbeConfig(
        model=models["bert-classification"],
        micro_batch=2,
        block_size=128,
        task="classification",
        num_labels=3,
        eval_batch=16,
        eval_logits="kept",
        eval_accumulation_steps=4,
    )
    result = runner.run(config, runner.settings.budget(64 * MiB))
    assert result.status == "ok" and set(result.phase_peaks) == {"train", "eval"}
    # Generation leaves no patched code and no memory behind: the child went on (no retirement).
    assert runner.children_started == started and runner.retired == retired


def test_evaluation_flags_are_checked_as_the_recipe_they_are():
    assert recipe_fields({"eval_batch": 8, "eval_logits": "kept"}, None)["eval_accumulation_steps"] == 1
    assert recipe_fields({"eval_batch": 4, "generate": True}, 64)["generation_max_length"] == 64
    with pytest.raises(BadInput, match="--generate is for --task seq2seq"):
        recipe_fields({"eval_batch": 4, "generate": True}, None)
    with pytest.raises(BadInput, match="give --generate too"):
        recipe_fields({"eval_batch": 4, "num_beams": 4}, 64)
    with pytest.raises(BadInput, match="give --eval-batch too"):
        ProbeConfig(model="gpt2", micro_batch=1, block_size=8, eval_logits="kept", eval_accumulation_steps=1)
    with pytest.raises(BadInput, match="needs --eval-accumulation-steps"):
        ProbeConfig(model="gpt2", micro_batch=1, block_size=8, eval_batch=8, eval_logits="kept")
    with pytest.raises(BadInput, match="--generate is for --task seq2seq"):
        ProbeConfig(model="gpt2", micro_batch=1, block_size=8, eval_batch=8, generation_max_length=16)


def test_eval_batch_auto_finds_the_largest_eval_batch_that_fits_in_one_probe(runner, models):
    # Kept logits grow with the eval batch: the roomier budget holds a larger one, and the phase's
    # peak is the found batch's (within the budget), not the failed attempt's.
    config = gpt2(
        models["gpt2"],
        **recipe_fields({"eval_batch": "auto", "eval_logits": "kept", "eval_accumulation_steps": 2}, None),
    )
    assert config.auto_eval_batch and config.eval_batch == 64 and "eval-auto64-kept2" in config.label()
    found = {}
    for mib in (20, 64):
        budget = runner.settings.budget(mib * MiB)
        result = runner.run(config, budget)
        assert result.status == "ok" and result.failed_phase is None, result.error
        assert budget.fits(result.phase_peaks["eval"]["reserved"])
        found[mib] = result.eval_batch_found
    assert 1 <= found[20] < found[64] < 64
    # The found batch, fixed, fits the same budget; the next larger one does not.
    fixed = runner.run(
        gpt2(models["gpt2"], eval_batch=found[20], eval_logits="kept", eval_accumulation_steps=2),
        runner.settings.budget(20 * MiB),
    )
    larger = runner.run(
        gpt2(models["gpt2"], eval_batch=2 * found[20], eval_logits="kept", eval_accumulation_steps=2),
        runner.settings.budget(20 * MiB),
    )
    assert fixed.status == "ok" and larger.status == "oom" and larger.failed_phase == "eval"
