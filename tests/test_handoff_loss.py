"""The hand-off trains as `autotune train` does under gradient accumulation: a real Trainer built only
from `best.training_arguments()` and `best.load_model()` logs the loss the model computes (within
10% of its eval loss, ln(vocabulary) or ln(labels) for a random model), for causal LM, seq2seq and
classification; without the fix (handoff/loss_scaling.py) transformers 5 logs it, and scales the
gradients, grad_accum times too large. `load_model` of a config-only directory (what a search
probes) builds random weights and says so."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from autotune.levers.config import ProbeConfig
from autotune.handoff.loss_scaling import ATTRIBUTE, loss_fix_note, needs_loss_fix
from tests.helpers.models import TINY_GPT2
from tests.helpers.store import best_of
from tests.helpers.tiny_tasks import TINY

ACCUMULATION = 4
VOCAB = 1024
CASES = {
    "causal-lm": (TINY_GPT2, {}),
    "seq2seq": (TINY["pegasus"], {"target_length": 16}),
    "classification": (TINY["bert-classification"], {"num_labels": 3}),
}


def examples(task: str, count: int) -> list[dict]:
    """Random examples of the task's shape (a random model's loss on them is about ln of its outputs)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(count):
        ids = torch.randint(6, VOCAB, (32,), generator=generator)
        if task == "causal-lm":
            rows.append({"input_ids": ids, "labels": ids})
        elif task == "seq2seq":
            rows.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones_like(ids),
                    "labels": torch.randint(6, VOCAB, (16,), generator=generator),
                }
            )
        else:
            rows.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones_like(ids),
                    "labels": torch.randint(0, 3, (), generator=generator),
                }
            )
    return rows


def first_steps(best, model_dir: Path, out: Path, *, fixed: bool = True) -> tuple[list[dict], float]:
    """Two optimizer steps of a Trainer made from the hand-off alone: their logs and the eval loss."""
    from transformers import Trainer, set_seed

    set_seed(0)  # the same random weights for the runs compared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = best.load_model(str(model_dir))
    if not fixed:
        model.__dict__.pop(ATTRIBUTE, None)  # what a model loaded by hand is: Trainer's default
    args = best.training_arguments(
        str(out),
        max_steps=2,
        logging_steps=1,
        report_to="none",
        learning_rate=1e-9,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        max_grad_norm=1e9,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=examples(best.task, 32), eval_dataset=examples(best.task, 8)
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, trainer.evaluate()["eval_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(CASES))
def test_a_trainer_from_the_hand_off_logs_the_models_loss_under_accumulation(tmp_path, task):
    config_json, fields = CASES[task]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config_json))
    best = best_of(ProbeConfig(str(model_dir), 2, 32, grad_accum=ACCUMULATION, task=task, **fields), "cpu")

    logs, eval_loss = first_steps(best, model_dir, tmp_path / "fixed")
    chance = math.log(3 if task == "classification" else VOCAB)
    assert eval_loss == pytest.approx(chance, rel=0.2), task
    assert logs[0]["loss"] == pytest.approx(eval_loss, rel=0.10), (task, logs, eval_loss)

    # What the fix is for: without it, the logged loss and the gradients are grad_accum times too large
    # for the models that average each micro-batch themselves, and the same for those that do not.
    unfixed, _ = first_steps(best, model_dir, tmp_path / "unfixed", fixed=False)
    scale = ACCUMULATION if needs_loss_fix(task, ACCUMULATION) else 1
    assert unfixed[0]["loss"] == pytest.approx(scale * logs[0]["loss"], rel=0.02), (task, unfixed, logs)
    assert unfixed[0]["grad_norm"] == pytest.approx(scale * logs[0]["grad_norm"], rel=0.02), (task, unfixed, logs)


def test_the_fix_is_said_wherever_only_arguments_travel(tmp_path):
    best = best_of(ProbeConfig("bert", 2, 32, grad_accum=4, task="classification", num_labels=2), "cpu")
    note = loss_fix_note("classification", 4)
    assert note is not None and "accepts_loss_kwargs = False" in note and "4x too large" in note
    assert f"note:      {note}" in str(best)
    document = best.trainer_args_document()
    assert document["model_attributes"] == {ATTRIBUTE: False} and document["notes"] == [note]
    assert any("accepts_loss_kwargs = False" in caveat for caveat in best.cli_caveats())
    # Nothing to say where nothing accumulates, or where Trainer's own scaling is right (causal LM).
    for quiet in (
        best_of(ProbeConfig("bert", 8, 32, task="classification", num_labels=2), "cpu"),
        best_of(ProbeConfig("gpt2", 2, 32, grad_accum=4), "cpu"),
    ):
        assert "accepts_loss_kwargs" not in str(quiet) + json.dumps(quiet.trainer_args_document())
        assert not any("accepts_loss_kwargs" in caveat for caveat in quiet.cli_caveats())


@pytest.mark.slow
def test_load_model_of_a_config_only_directory_builds_random_weights_and_says_so(tmp_path):
    model_dir = tmp_path / "bert"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY["bert-classification"]))
    best = best_of(ProbeConfig(str(model_dir), 2, 32, grad_accum=2, task="classification", num_labels=3), "cpu")
    with pytest.warns(UserWarning, match="no weights.*random weights"):
        model = best.load_model(str(model_dir))
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 3
    assert getattr(model, ATTRIBUTE) is False
