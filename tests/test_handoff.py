"""The hand-off's forms without a training run: TrainingArguments named as the installed transformers
names them (and `tf32` always), the split of load arguments from config overrides, and what
`print(autotune.best(...))` says, without importing transformers. (Real Trainer runs, and the installed
transformers taking the hand-off without a deprecation warning: tests/search/test_handoff_e2e.py.)"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from autotune.handoff import argument_names
from autotune.levers.config import ProbeConfig
from autotune.handoff import checkpointing_argument_names
from autotune.levers.recipes import peft_text
from tests.helpers.store import best_of

GiB = 2**30


@pytest.fixture
def transformers_version(monkeypatch):
    """Pretend another transformers is installed (as importlib.metadata reports it)."""

    def pretend(version: str | None) -> None:
        def read(name: str) -> str:
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version if name == "transformers" else importlib.metadata.version(name)

        monkeypatch.setattr(argument_names.importlib.metadata, "version", read)
        checkpointing_argument_names.cache_clear()

    yield pretend
    checkpointing_argument_names.cache_clear()


@pytest.mark.parametrize(
    "version, names",
    [
        ("5.17.0", ("gradient_checkpointing", "gradient_checkpointing_kwargs")),
        ("5.22.2", ("gradient_checkpointing", "gradient_checkpointing_kwargs")),
        ("5.23.0", ("activation_checkpointing", "activation_checkpointing_kwargs")),
        ("5.24.1.dev0", ("activation_checkpointing", "activation_checkpointing_kwargs")),
        ("6.0.0", ("activation_checkpointing", "activation_checkpointing_kwargs")),
        (None, ("gradient_checkpointing", "gradient_checkpointing_kwargs")),  # not installed: what every 5.x takes
    ],
)
def test_checkpointing_is_named_as_the_installed_transformers_names_it(transformers_version, version, names):
    transformers_version(version)
    best = best_of(ProbeConfig("gpt2", 2, 64, grad_accum=2, checkpointing=True))
    kwargs = best.trainer_kwargs()
    assert kwargs[names[0]] is True and kwargs[names[1]] == {"use_reentrant": False}
    assert not {"gradient_checkpointing", "activation_checkpointing"} - {names[0]} & set(kwargs)
    # The example scripts' flag keeps the old name: their HfArgumentParser still takes it in every 5.x.
    assert "--gradient_checkpointing --gradient_checkpointing_kwargs" in best.cli_flags()


@pytest.mark.parametrize("precision, tf32", [("fp32", False), ("bf16", False), ("fp16", False), ("tf32", True)])
def test_trainer_args_always_name_tf32(precision, tf32):
    document = json.loads(best_of(ProbeConfig("gpt2", 2, 64, precision=precision, compile=True)).render("trainer-args"))
    assert document["training_arguments"]["tf32"] is tf32 and document["training_arguments"]["torch_compile"] is True
    # The example scripts' flags say it too: left out, transformers would turn TF32 on for a compiled run.
    flags = best_of(ProbeConfig("gpt2", 2, 64, precision=precision, compile=True)).cli_flags()
    assert f"--tf32 {'true' if tf32 else 'false'}" in flags


def test_load_arguments_and_config_overrides_split_what_model_kwargs_holds():
    classifier = best_of(ProbeConfig("bert", 2, 64, task="classification", num_labels=3, weights="bf16"))
    assert classifier.load_kwargs() == {"attn_implementation": "sdpa", "dtype": "bfloat16"}
    assert classifier.config_overrides() == {"use_cache": False, "num_labels": 3}
    assert classifier.model_kwargs() == {**classifier.load_kwargs(), **classifier.config_overrides()}
    assert list(classifier.model_kwargs()) == ["attn_implementation", "use_cache", "dtype", "num_labels"]
    qlora = best_of(ProbeConfig("gpt2", 2, 64, precision="bf16", peft=peft_text("qlora")))
    assert "quantization_config" in qlora.load_kwargs() and "quantization_config" not in qlora.config_overrides()


def test_print_best_says_what_won_how_fast_what_it_needs_and_how_to_hand_it_off():
    config = ProbeConfig("gpt2", 4, 512, grad_accum=8, precision="bf16")
    row = dict(
        study="gpt2-8GiB",
        config_key="k",
        tokens_per_s=12345.0,
        step_seconds=1.327,
        peak_reserved_bytes=5 * GiB,
        context_bytes=GiB // 2,
        budget_bytes=8 * GiB,
        margin_bytes=GiB // 4,
    )
    text = str(best_of(config, **row))
    lines = text.splitlines()
    assert lines[0] == "autotune.best('gpt2-8GiB'): mb4x8 blk512 bf16 no-ckpt sdpa" and len(lines) >= 7
    assert "12,345 tokens/s (1.327 s per optimizer step)" in text
    assert (
        "needs 5.50 GiB of the 8.00 GiB budget (peak reserved 5.00 GiB + context 512.00 MiB), 2.25 GiB to spare "
        "after the 256.00 MiB margin"
    ) in text
    assert "confirmed: no: no confirmation round ran" in text
    assert 'model = best.load_model("gpt2")' in text and "args = best.training_arguments(" in text
    assert "peft.get_peft_model" not in text
    assert repr(best_of(config, **row)) == text
    confirmed = {
        "winner": "k",
        "winner_label": "mb4x8",
        "runner_up": "mb2x16 blk512 bf16 no-ckpt sdpa",
        "margin": 0.12,
        "noise": 0.02,
        "confirmed": True,
        "tied": [],
    }
    assert "confirmed: yes: 12% ± 2% faster than the runner-up, mb2x16 blk512 bf16 no-ckpt sdpa" in str(
        best_of(config, confirmation=confirmed, **row)
    )
    tied = {**confirmed, "confirmed": False, "tied": ["mb2x16 blk512 bf16 no-ckpt sdpa"], "margin": 0.01}
    assert "confirmed: no, a tie: within the 2% noise of mb2x16" in str(best_of(config, confirmation=tied, **row))
    lora = str(best_of(ProbeConfig("gpt2", 4, 512, grad_accum=8, peft=peft_text("lora")), **row))
    assert "model = peft.get_peft_model(model, best.lora_config())" in lora


def test_a_study_of_trls_step_is_handed_to_trl_and_warns_where_another_trainer_runs_it():
    """The probes timed TRL's SFTTrainer step (--trainer trl): print(best) hands off to TRL, and
    the formats whose run takes transformers' Trainer step say that neither its memory nor its
    speed was measured; a study of Trainer's step handed to TRL says the converse."""
    trl = best_of(ProbeConfig("gpt2", 4, 512, grad_accum=2, trainer="trl"))
    text = str(trl)
    assert ", trainer=trl" in text and 'SFTConfig(output_dir="out", **sft_config)' in text
    assert "best.training_arguments(" not in text and "autotune train --study" not in text
    for fmt in ("trainer-args", "cli", "accelerate", "axolotl", "llamafactory"):
        assert any(note.startswith("warning: the probes timed TRL's SFTTrainer step") for note in trl.notes(fmt)), fmt
    assert not any("SFTTrainer" in note for fmt in ("trl", "json", "yaml") for note in trl.notes(fmt))
    plain = best_of(ProbeConfig("gpt2", 4, 512, grad_accum=2))
    assert any(
        note.startswith("warning: the probes timed transformers' Trainer step, and --format trl runs TRL's")
        for note in plain.notes("trl")
    )
    assert not any("SFTTrainer" in note for note in plain.notes("trainer-args"))
