"""The hand-off of a real search on CPU: TrainingArguments, a LoraConfig, and the example scripts'
flags pasted as users paste them. (Apart from test_search_e2e.py, so that pytest's two workers
share the slow end-to-end files evenly.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autotune.models import resolve_model
from autotune.probe import ProbeRunner, ProbeSettings
from autotune.search import SearchOptions, run_search
from autotune.space import SearchSpace
from autotune.store import open_store
from tests.cli import autotune, autotune_command
from tests.fakes import request

pytestmark = pytest.mark.slow
MiB = 2**20
BUDGET = 24 * MiB
MARGIN = int(0.05 * BUDGET)


def test_best_trainer_args_build_real_training_arguments(tiny_model, tmp_path):
    spec = resolve_model(tiny_model)
    with open_store() as store, ProbeRunner(ProbeSettings(device="cpu", measure_steps=1)) as runner:
        space = SearchSpace.build(spec, micro_batches=(2, 4), block_sizes=(64,), precisions=("bf16",),
                                  checkpointing=(True,), attentions=("eager",), effective_batch=4)
        run_search(request(space, spec, BUDGET, MARGIN, SearchOptions(study="handoff")), runner, store)
    proc = autotune("best", "--study", "handoff", "--format", "trainer-args", timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), **doc["training_arguments"])
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 4
    assert args.bf16 and args.use_cpu  # the study ran on CPU, so the hand-off trains there
    assert getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    assert doc["model_kwargs"] == {"attn_implementation": "eager", "use_cache": False, "dtype": "float32"}
    assert doc["block_size"] == 64

    from autotune import best as best_of

    best = best_of("handoff")
    assert best.training_arguments(output_dir=str(tmp_path / "o2")).per_device_train_batch_size == best.config.micro_batch
    assert best.device_type == "cpu"
    proc = autotune("best", "--study", "handoff", "--format", "cli", timeout=60)
    flags = proc.stdout
    assert "--bf16" in flags and "--gradient_checkpointing" in flags and "--block_size 64" in flags and "--use_cpu" in flags
    assert "attention eager" in proc.stderr  # what run_clm.py has no flag for is said, on stderr

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
    pasted = subprocess.run(["bash", "-c", f"{sys.executable} {tmp_path / 'parse.py'} --output_dir {tmp_path / 'o3'} $({command})"],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert pasted.stdout.strip().split("|") == ["4", "64", "True", "{'use_reentrant': False}", "True"]


def test_a_lora_search_over_two_optimizers_hands_off_trainer_arguments_and_a_lora_config(tiny_model, tmp_path):
    # Recipe levers the user allows: two optimizers to choose between, LoRA fixed for the study.
    from peft import LoraConfig
    from transformers import TrainingArguments

    from autotune import best as best_of
    from autotune.recipes import peft_text

    spec = resolve_model(tiny_model)
    with open_store() as store, ProbeRunner(ProbeSettings(device="cpu", measure_steps=1)) as runner:
        space = SearchSpace.build(spec, micro_batches=(2, 4), block_sizes=(64,), precisions=("fp32",), checkpointing=(False,),
                                  attentions=("sdpa",), effective_batch=4, optimizers=("adamw", "adafactor"),
                                  peft=peft_text("lora", rank=4))
        outcome = run_search(request(space, spec, BUDGET, MARGIN, SearchOptions(study="lora", confirm=False)), runner, store)
        probes = store.probes("lora")
    assert outcome.finished and outcome.best is not None
    assert {p.config.optimizer for p in probes if p.result.status == "ok"} == {"adamw", "adafactor"}
    assert all(p.config.peft == peft_text("lora", rank=4) and p.result.trainable_parameters < p.result.parameters
               for p in probes if p.result.status == "ok")
    assert all(p.predicted_peak_bytes for p in probes)  # the estimator traced the adapters too

    doc = json.loads(autotune("best", "--study", "lora", "--format", "trainer-args", timeout=120).stdout)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **doc["training_arguments"])
    assert args.optim == {"adamw": "adamw_torch_fused", "adafactor": "adafactor"}[outcome.best.config.optimizer]
    lora = LoraConfig(**doc["lora_config"])
    assert (lora.r, lora.lora_alpha, lora.task_type) == (4, 16, "CAUSAL_LM")
    assert isinstance(best_of("lora").lora_config(), LoraConfig)
    assert "lora-r4" in autotune("leaderboard", "--study", "lora", timeout=60).stdout
