"""The hand-off of a real search on CPU: TrainingArguments, a LoraConfig, and the example scripts'
flags pasted as users paste them. (Apart from test_search_e2e.py, so that pytest's two workers
share the slow end-to-end files evenly.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autotune.specs.models import resolve_model
from autotune.probe import ProbeSettings
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from tests.helpers.cli import autotune_command, invoke
from tests.helpers.models import TINY_GPT2
from tests.helpers.fakes import request

pytestmark = pytest.mark.slow
MiB = 2**20
BUDGET = 24 * MiB
MARGIN = int(0.05 * BUDGET)


def test_best_trainer_args_build_real_training_arguments(tiny_model, tmp_path, probe_runner):
    spec = resolve_model(tiny_model)
    with open_store() as store:
        runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1))
        space = SearchSpace.build(
            spec,
            micro_batches=(2, 4),
            block_sizes=(64,),
            precisions=("bf16",),
            checkpointing=(True,),
            attentions=("eager",),
            effective_batch=4,
        )
        # (No memory prediction, no confirmation round: what is handed off is the probes' pick; the
        # estimator's child and the second windows are seconds that no assertion here reads.)
        run_search(
            request(space, spec, BUDGET, MARGIN, SearchOptions(study="handoff", predict=False, confirm=False)),
            runner,
            store,
        )
    # `best` in this process (`invoke`, as the console script runs it): what it prints is the subject;
    # the pasted command line below is run by a real shell.
    proc = invoke("best", "--study", "handoff", "--format", "trainer-args")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), **doc["training_arguments"])
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 4
    assert args.bf16 and args.use_cpu  # the study ran on CPU, so the hand-off trains there
    assert getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    assert doc["model_kwargs"] == {"attn_implementation": "eager", "use_cache": False, "dtype": "float32"}
    assert doc["block_size"] == 64
    # The OpenMP settings the probes ran under travel with the answer (a run whose idle OpenMP threads
    # spin beside other work ran at 0.03-0.15x of its probe, issue 56).
    assert doc["environment"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert doc["environment"].get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")

    from autotune import best as best_of

    best = best_of("handoff")
    assert (
        best.training_arguments(output_dir=str(tmp_path / "o2")).per_device_train_batch_size == best.config.micro_batch
    )
    assert best.device_type == "cpu"
    proc = invoke("best", "--study", "handoff", "--format", "cli")
    flags = proc.stdout
    assert (
        "--bf16" in flags
        and "--gradient_checkpointing" in flags
        and "--block_size 64" in flags
        and "--use_cpu" in flags
    )
    assert "attention eager" in proc.stderr  # what run_clm.py has no flag for is said, on stderr
    assert "the probes ran with OMP_WAIT_POLICY=PASSIVE" in proc.stderr and "start run_clm.py with them" in proc.stderr
    assert best.to_dict()["environment"] == doc["environment"] == best.environment()
    assert "environment: OMP_WAIT_POLICY=PASSIVE" in str(best)

    # Pasted as users do, `script.py ... $(autotune best --format cli)`: the words an example
    # script's HfArgumentParser gets (run_clm.py's own block_size beside TrainingArguments).
    parse = (
        "import dataclasses, sys\n"
        "from transformers import HfArgumentParser, TrainingArguments\n"
        "@dataclasses.dataclass\n"
        "class Data:\n"
        "    block_size: int = None\n"
        "args, data = HfArgumentParser((TrainingArguments, Data)).parse_args_into_dataclasses()\n"
        "kwargs = getattr(args, 'activation_checkpointing_kwargs', None) or args.gradient_checkpointing_kwargs\n"
        "print(args.per_device_train_batch_size * args.gradient_accumulation_steps, data.block_size, args.bf16, kwargs, args.use_cpu, sep='|')\n"
    )
    (tmp_path / "parse.py").write_text(parse)
    command = " ".join(autotune_command("best", "--study", "handoff", "--format", "cli"))
    pasted = subprocess.run(
        ["bash", "-c", f"{sys.executable} {tmp_path / 'parse.py'} --output_dir {tmp_path / 'o3'} $({command})"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert pasted.stdout.strip().split("|") == ["4", "64", "True", "{'use_reentrant': False}", "True"]


def test_a_lora_search_over_two_optimizers_hands_off_trainer_arguments_and_a_lora_config(
    tiny_model, tmp_path, probe_runner
):
    # Recipe levers the user allows: two optimizers to choose between, LoRA fixed for the study.
    from peft import LoraConfig
    from transformers import TrainingArguments

    from autotune import best as best_of
    from autotune.levers.recipes import peft_text

    spec = resolve_model(tiny_model)
    with open_store() as store:
        runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1))
        space = SearchSpace.build(
            spec,
            micro_batches=(2, 4),
            block_sizes=(64,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=4,
            optimizers=("adamw", "adafactor"),
            peft=peft_text("lora", rank=4),
        )
        outcome = run_search(
            request(space, spec, BUDGET, MARGIN, SearchOptions(study="lora", confirm=False)), runner, store
        )
        probes = store.probes("lora")
    assert outcome.finished and outcome.best is not None
    assert {p.config.optimizer for p in probes if p.result.status == "ok"} == {"adamw", "adafactor"}
    assert all(
        p.config.peft == peft_text("lora", rank=4) and p.result.trainable_parameters < p.result.parameters
        for p in probes
        if p.result.status == "ok"
    )
    assert all(p.predicted_peak_bytes for p in probes)  # the estimator traced the adapters too

    doc = json.loads(invoke("best", "--study", "lora", "--format", "trainer-args").stdout)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **doc["training_arguments"])
    assert args.optim == {"adamw": "adamw_torch_fused", "adafactor": "adafactor"}[outcome.best.config.optimizer]
    lora = LoraConfig(**doc["lora_config"])
    assert (lora.r, lora.lora_alpha, lora.task_type) == (4, 16, "CAUSAL_LM")
    assert isinstance(best_of("lora").lora_config(), LoraConfig)
    assert "lora-r4" in invoke("leaderboard", "--study", "lora").stdout


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_hand_off() -> str:
    """The README's Python block up to `trainer.train()`: the hand-off as a newcomer copies it."""
    block = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    return block[: block.index("trainer.train()") + len("trainer.train()")] + "\n"


def as_run_here(script: str, study: str) -> str:
    """The README's block with this test's study and model, and two steps: nothing else changed."""
    for old, new in (
        ('autotune.best("gpt2-8GiB")', f"autotune.best({study!r})"),
        ('best.load_model("gpt2")', "best.load_model(MODEL)"),
        (
            'best.training_arguments(output_dir="out")',
            'best.training_arguments(output_dir="out", max_steps=2, report_to="none")',
        ),
    ):
        assert old in script, f"README.md's Python block no longer has {old}"
        script = script.replace(old, new)
    return script


def test_the_readme_hand_off_trains_with_trainer_from_a_directory_and_from_a_config(tmp_path, monkeypatch, capsys):
    """The README's Python block, run as written, on a study stored by hand (one fitting CPU probe with
    checkpointing): a real Trainer takes two steps, once with the model loaded from a saved directory
    (from_pretrained) and once built from a config object (from_config, which refuses config fields
    such as use_cache as keyword arguments)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotune.host.environment import Environment
    from tests.helpers.store import config, make_study, result

    cpu = Environment("cpu", "cpu: test", 8 * 2**30, torch_version=torch.__version__)
    with open_store() as store:
        study = make_study(store, "tiny-cpu", environment=cpu)
        store.record_probe(
            study.id,
            config(2, block_size=32, grad_accum=1, checkpointing=True),
            result(),
            env_fingerprint=cpu.fingerprint(),
        )
    fields = {k: v for k, v in TINY_GPT2.items() if k not in ("model_type", "architectures")}
    saved = tmp_path / "saved-gpt2"
    GPT2LMHeadModel(GPT2Config(**fields)).save_pretrained(saved)
    blocks = torch.randint(0, TINY_GPT2["vocab_size"], (8, 32)).tolist()
    train_dataset = [{"input_ids": ids, "labels": ids} for ids in blocks]
    monkeypatch.chdir(tmp_path)
    script = as_run_here(readme_hand_off(), "tiny-cpu")

    user_config = GPT2Config(**fields)
    for model in (str(saved), user_config):
        namespace = {"__name__": "readme", "MODEL": model, "train_dataset": train_dataset}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(script, str(README), "exec"), namespace)
        trainer = namespace["trainer"]
        assert trainer.state.global_step == 2 and trainer.args.use_cpu
        assert trainer.args.per_device_train_batch_size == 2 and trainer.args.tf32 is False
        assert trainer.model.config.use_cache is False and trainer.model.config._attn_implementation == "sdpa"
        checkpointed = getattr(trainer.model, "is_activation_checkpointing", None)  # transformers >= 5.23
        assert checkpointed if checkpointed is not None else trainer.model.is_gradient_checkpointing
        assert trainer.model.name_or_path == (str(saved) if isinstance(model, str) else "")
        assert not [w for w in caught if "checkpointing" in str(w.message) and "deprecated" in str(w.message)]
        losses = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
        assert losses and all(loss == loss and loss > 0 for loss in losses)
    assert user_config.use_cache is True  # load_model changed a copy
    # By hand, as the README's comment says: the overrides on the config, the load arguments to from_config.
    from transformers import AutoModelForCausalLM

    from autotune import best as best_of

    best = best_of("tiny-cpu")
    user_config.update(best.config_overrides())
    assert AutoModelForCausalLM.from_config(user_config, **best.load_kwargs()).config.use_cache is False
    # A QLoRA base is a checkpoint quantized as it loads: from a config, refused with what to pass.
    from autotune.vocabulary.errors import BadInput
    from autotune.handoff import BestConfig
    from autotune.levers.recipes import peft_text
    from tests.helpers.store import leaderboard_row

    qlora = BestConfig(leaderboard_row(config(2, precision="bf16", peft=peft_text("qlora"))), "cuda")
    with pytest.raises(BadInput, match="pass its hub id or directory to load_model, not a config"):
        qlora.load_model(user_config)
    printed = capsys.readouterr().out
    assert "autotune.best('tiny-cpu'): mb2x1 blk32 fp32 ckpt sdpa" in printed and "of the 8.00 GiB budget" in printed
