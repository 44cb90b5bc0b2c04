"""`autotune train` trains the recipe its winner was measured with: the optimizer the probe made
(TrainingArguments' optim), pure bf16 weights, and LoRA adapters, saved as an adapter (and with
--merge, as a whole merged model); a --peft or --merge that the study cannot honour is refused
before anything runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.levers.config import ProbeConfig
from autotune.levers.recipes import peft_text
from autotune.store import open_store
from autotune.train import SUMMARY_FILE, TrainOptions, train
from autotune.train.winner import Winner
from tests.helpers.cli import assert_usage_error, autotune
from tests.helpers.store import leaderboard_row
from tests.helpers.training import STUDY


@pytest.mark.parametrize(
    "optimizer, weights, precision, optim, optim_args, bf16",
    [
        ("adafactor", "bf16", "fp32", "adafactor", None, False),  # pure bf16 without autocast
        ("sgd", "bf16", "bf16", "sgd", "momentum=0.9", True),
        ("adamw", "fp32", "fp32", "adamw_torch_fused", None, False),
    ],
)
def test_training_arguments_carry_the_optimizer_and_precision_the_probe_measured(
    tmp_path, optimizer, weights, precision, optim, optim_args, bf16
):
    import torch

    from autotune.train.run import training_arguments

    config = ProbeConfig(
        model="gpt2",
        micro_batch=2,
        block_size=64,
        grad_accum=2,
        precision=precision,
        optimizer=optimizer,
        weights=weights,
    )
    args = training_arguments(
        Winner(study=None, row=leaderboard_row(config)),  # type: ignore[arg-type]
        TrainOptions(dataset="x.txt", max_steps=1),
        tmp_path,
        torch.device("cpu"),
        has_eval=False,
    )
    assert (args.optim, args.optim_args, args.bf16, args.fp16) == (optim, optim_args, bf16, False)


def test_the_model_loads_as_the_probe_built_it_bf16_with_adapters_after_checkpointing(tiny_model):
    import torch
    from peft import PeftModel

    from autotune.specs.models import resolve_model
    from autotune.train.loading import build_model

    config = ProbeConfig(
        model=tiny_model,
        micro_batch=1,
        block_size=32,
        precision="bf16",
        checkpointing=True,
        weights="bf16",
        peft=peft_text("lora", rank=4),
    )
    model = build_model(resolve_model(tiny_model), config, torch.device("cpu"), weights=None)
    assert isinstance(model, PeftModel)
    base = model.get_base_model()
    assert base.is_activation_checkpointing and base.transformer.wte.weight.dtype == torch.bfloat16
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


@pytest.mark.slow
def test_lora_searches_with_its_adapters_trains_saves_the_adapter_and_merges(workspace, tmp_path, monkeypatch):
    """One real run: the search (narrowed to one checkpointed candidate) is asked for the adapters,
    the run trains them under the budget, saves them, and --merge saves the merged model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import autotune.search
    from autotune.probe import ProbeSettings

    real_search = autotune.search.search
    asked = {}

    def narrow_search(model, budget, *, settings, options, db=None, on_event=None, on_start=None, **space_args):
        asked.update(space_args)
        return real_search(
            model,
            budget,
            settings=ProbeSettings(device="cpu", measure_steps=1),
            options=replace(options, predict=False),
            db=db,
            on_event=on_event,
            on_start=on_start,
            micro_batches=(2,),
            block_sizes=(64,),
            precisions=("fp32",),
            checkpointing=(True,),
            attentions=("sdpa",),
            effective_batch=2,
            **space_args,
        )

    monkeypatch.setattr(autotune.search, "search", narrow_search)
    lora = peft_text("lora", rank=4, alpha=8)
    out = tmp_path / "run"
    lines: list[str] = []
    outcome = train(
        TrainOptions(
            dataset=str(workspace.corpus),
            output_dir=str(out),
            max_steps=3,
            device="cpu",
            learning_rate=1e-3,
            merge=True,
        ),
        model=str(workspace.model),
        gpu_budget=64 * 2**20,
        study="tiny-lora",
        peft=lora,
        db=workspace.db,
        echo=lines.append,
    )
    assert asked == {"peft": lora}
    assert outcome.finished and outcome.summary.config.peft == lora and outcome.summary.config.checkpointing
    # The run holds what the probe measured: the adapters' gradients and optimizer state only.
    assert 0.95 < outcome.summary.peak_vs_probe < 1.05, outcome.summary
    assert any(line.startswith("merged: ") for line in lines), lines

    # The output directory holds the adapter, not a whole model; it loads onto the base.
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(workspace.model)
    base_parameters = sum(p.numel() for p in base.parameters())
    adapted = PeftModel.from_pretrained(base, out, is_trainable=True)
    trainable = {name: p for name, p in adapted.named_parameters() if p.requires_grad}
    assert 0 < sum(p.numel() for p in trainable.values()) < base_parameters / 10
    assert any(p.abs().sum() > 0 for name, p in trainable.items() if "lora_B" in name)  # trained: B starts at zero

    # --merge: a whole model that loads without peft and computes what base + adapters compute.
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert type(merged).__name__ == "GPT2LMHeadModel" and not any(
        "lora" in name for name, _ in merged.named_parameters()
    )
    ids = torch.randint(0, 500, (1, 16))
    adapted.eval(), merged.eval()
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["merged_dir"] == str((out / "merged").resolve()) and summary["config"]["peft"] == lora
    assert summary["training_arguments"]["optim"] == "adamw_torch_fused"


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--merge"], f"--merge merges LoRA adapters into the base, but study '{STUDY}' fine-tunes the whole model"),
        (["--peft", "lora", "--lora-rank", "4"], f"contradicts study '{STUDY}', which measured full fine-tuning"),
    ],
)
def test_a_recipe_the_study_did_not_measure_is_one_line_and_exit_2(workspace, tmp_path, flags, needle):
    with open_store(workspace.db) as store:
        before = len(store.runs.all())
    proc = autotune(
        "train",
        "--study",
        workspace.study,
        "--dataset",
        str(workspace.corpus),
        *flags,
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--db",
        workspace.db,
    )
    assert_usage_error(proc, needle)
    assert not (tmp_path / "out").exists()
    with open_store(workspace.db) as store:
        assert len(store.runs.all()) == before
