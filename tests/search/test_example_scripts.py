"""The real Hugging Face example scripts, unmodified, fed `$(autotune best --format cli)` as users
paste it: run_clm.py, run_summarization.py and run_classification.py each train two steps on CPU
for a winner with activation checkpointing and one without, and the Trainer's own record (its
saved TrainingArguments, the tokens it saw, the dtype of the weights it saved) shows the winner's
levers reached it.

The scripts are third-party code and are not committed here: a developer with a network puts
them, unmodified, in tests/examples/ (git ignores it) or in the directory AUTOTUNE_EXAMPLE_SCRIPTS
names, from the transformers tag that matches the installed version (their `check_min_version`
must pass), e.g. `git clone --depth 1 -b v5.17.0 https://github.com/huggingface/transformers t`
and `cp t/examples/pytorch/{language-modeling/run_clm,summarization/run_summarization,
text-classification/run_classification}.py tests/examples/`. A test whose script is missing skips,
saying so."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from autotune.host.environment import Environment
from autotune.store import open_store
from tests.helpers.cli import autotune_command
from tests.helpers.models import TINY_GPT2
from tests.helpers.store import ENV, config, make_study, result
from tests.helpers.tiny_tasks import TINY
from tests.helpers.corpus import corpus_text, write_task_tokenizer, write_tokenizer

EXAMPLES = Path(os.environ.get("AUTOTUNE_EXAMPLE_SCRIPTS") or Path(__file__).parents[1] / "examples")
STEPS = 2
# The studies ran on CPU, so the hand-off says --use_cpu and the scripts train here.
CPU = Environment("cpu", "cpu: test", 8 * 2**30, torch_version="2.13.0", transformers_version="5.23.0")

# run_classification.py and run_summarization.py call evaluate.load("accuracy") / ("rouge") even
# for --do_train alone, which would fetch the metric from the hub; evaluate loads a directory of
# that name in the working directory first, so the scripts run from one holding this stand-in.
STUB_METRIC = """import datasets
import evaluate


class Stub(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="", citation="", inputs_description="", features=datasets.Features(
            {"predictions": datasets.Value("string"), "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        return {"matches": sum(p == r for p, r in zip(predictions, references))}
"""


@dataclass(frozen=True)
class Case:
    script: str  # under EXAMPLES
    model: str  # a model directory of the workspace
    data: tuple[str, ...]  # the script's data flags, relative to the workspace
    winner: dict  # ProbeConfig fields of the stored winner
    length: int  # tokens per sequence the Trainer must see (block / source / max_seq_length)

    @property
    def checkpointing(self) -> bool:
        return bool(self.winner.get("checkpointing"))


# run_clm.py with and without checkpointing; the other two scripts one each, the other way round:
# each script process spends most of its ~10 s CPU importing, and the flags of either kind are
# read by TrainingArguments alike in every script.
CASES = {
    # Checkpointing, bf16 autocast over pure bf16 weights (--bf16 --dtype bfloat16).
    "clm-checkpointing": Case(
        "run_clm.py",
        "gpt2",
        ("--train_file", "train.txt"),
        {
            "micro_batch": 2,
            "grad_accum": 3,
            "block_size": 32,
            "checkpointing": True,
            "precision": "bf16",
            "weights": "bf16",
        },
        32,
    ),
    # No checkpointing, fp32, an optimizer with --optim_args.
    "clm-plain": Case(
        "run_clm.py",
        "gpt2",
        ("--train_file", "train.txt"),
        {"micro_batch": 2, "grad_accum": 2, "block_size": 48, "optimizer": "sgd"},
        48,
    ),
    "seq2seq-checkpointing": Case(
        "run_summarization.py",
        "t5",
        ("--train_file", "pairs.json"),
        {
            "micro_batch": 2,
            "grad_accum": 2,
            "block_size": 32,
            "checkpointing": True,
            "task": "seq2seq",
            "target_length": 16,
        },
        32,
    ),
    "classification-plain": Case(
        "run_classification.py",
        "bert",
        ("--train_file", "train.csv", "--validation_file", "validation.csv"),
        {"micro_batch": 4, "grad_accum": 1, "block_size": 24, "task": "classification", "num_labels": 3},
        24,
    ),
}


def _save_model(directory: Path, fields: dict, auto_class: str, tokenizer) -> None:
    """A model directory as a fine-tune starts from: config, random weights, tokenizer."""
    import torch
    import transformers

    fields = dict(fields)
    torch.manual_seed(0)
    model = getattr(transformers, auto_class).from_config(
        transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    )
    model.save_pretrained(directory)
    tokenizer(directory)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Models, data, the metric stand-ins and a database holding one study per case."""
    root = tmp_path_factory.mktemp("examples")
    text = corpus_text()[:20_000]
    _save_model(root / "gpt2", TINY_GPT2, "AutoModelForCausalLM", lambda d: write_tokenizer(text, d))
    _save_model(root / "t5", TINY["t5"], "AutoModelForSeq2SeqLM", lambda d: write_task_tokenizer(text, d))
    _save_model(
        root / "bert",
        TINY["bert-classification"],
        "AutoModelForSequenceClassification",
        lambda d: write_task_tokenizer(text, d),
    )

    (root / "train.txt").write_text(text)
    # run_summarization.py: the first column is the text, the second the summary.
    (root / "pairs.json").write_text(
        "".join(
            json.dumps({"text": text[i : i + 300], "summary": text[i + 300 : i + 360]}) + "\n"
            for i in range(0, 8_000, 400)
        )
    )
    for split in ("train", "validation"):
        with (root / f"{split}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])  # run_classification.py's default columns
            writer.writerows([text[i * 100 : i * 100 + 100], i % 3] for i in range(24))
    for metric in ("accuracy", "rouge"):
        (root / metric).mkdir()
        (root / metric / f"{metric}.py").write_text(STUB_METRIC)
    # run_summarization.py looks for nltk's punkt at import (and downloads it if missing); training
    # alone never splits sentences.
    (root / "nltk_data" / "tokenizers" / "punkt").mkdir(parents=True)

    with open_store(f"sqlite:///{root / 'studies.db'}") as store:
        for name, case in CASES.items():
            study = make_study(store, name, environment=CPU)
            store.record_probe(study.id, config(**case.winner), result(), env_fingerprint=CPU.fingerprint())
    return root


def _script(case: Case) -> Path:
    path = EXAMPLES / case.script
    if not path.exists():
        pytest.skip(
            f"{path} is missing: copy it unmodified from transformers' examples/pytorch (the tag of the "
            f"installed version), or set AUTOTUNE_EXAMPLE_SCRIPTS to a directory holding it"
        )
    if case.script == "run_summarization.py" and importlib.util.find_spec("nltk") is None:
        pytest.skip("run_summarization.py imports nltk: pip install nltk")
    return path


def _paste(shell: str, name: str, request: pytest.FixtureRequest, out: Path) -> subprocess.CompletedProcess:
    """`SCRIPT ... $(autotune best --format cli)` for case `name`, run by `shell` as a user types it."""
    case = CASES[name]
    script = _script(case)  # before the workspace: a missing script skips without building it
    workspace: Path = request.getfixturevalue("workspace")
    fixed = [
        sys.executable,
        str(script),
        "--model_name_or_path",
        case.model,
        *case.data,
        "--output_dir",
        str(out),
        "--do_train",
        "--max_steps",
        str(STEPS),
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
        "--include_num_input_tokens_seen",
    ]
    best = autotune_command("best", "--study", name, "--db", f"sqlite:///{workspace / 'studies.db'}", "--format", "cli")
    command = f"{shlex.join(fixed)} $({shlex.join(best)})"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(out.parent / "hf-home"),
        "HF_DATASETS_CACHE": str(out.parent / "hf-datasets"),
        "NLTK_DATA": str(workspace / "nltk_data"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.run([shell, "-c", command], cwd=workspace, env=env, capture_output=True, text=True, timeout=300)


def _assert_trained_with_the_winner(case: Case, out: Path) -> None:
    import torch

    winner = config(**case.winner)
    args = torch.load(out / "training_args.bin", weights_only=False)  # the Trainer's own TrainingArguments
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        winner.micro_batch,
        winner.grad_accum,
    )
    assert args.use_cpu and (args.bf16, args.fp16) == (winner.precision == "bf16", winner.precision == "fp16")
    assert (
        str(getattr(args.optim, "value", args.optim)) == {"adamw": "adamw_torch_fused", "sgd": "sgd"}[winner.optimizer]
    )
    # transformers 5.2x reads --gradient_checkpointing into activation_checkpointing; 5.17 keeps the name.
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    assert bool(checkpointing) == case.checkpointing
    if case.checkpointing:
        kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
        assert kwargs == {"use_reentrant": False}
    if winner.optimizer == "sgd":
        assert args.optim_args == "momentum=0.9"
    # Every input sequence the Trainer fed the model was the winner's length, in its batches.
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    assert state["num_input_tokens_seen"] == STEPS * winner.micro_batch * winner.grad_accum * case.length
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        dtype = weights.get_tensor(next(iter(weights.keys()))).dtype
    assert dtype == (torch.bfloat16 if winner.weights == "bf16" else torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_an_example_script_trains_with_the_pasted_flags(name, request, tmp_path):
    proc = _paste("bash", name, request, tmp_path / "out")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _assert_trained_with_the_winner(CASES[name], tmp_path / "out")


@pytest.mark.slow
def test_zsh_splits_the_flags_as_bash_does(request, tmp_path):
    # zsh does not split an unquoted $param, but it does split $(...): the JSON word stays whole.
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    proc = _paste("zsh", "clm-checkpointing", request, tmp_path / "out")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _assert_trained_with_the_winner(CASES["clm-checkpointing"], tmp_path / "out")


def test_pure_bf16_weights_are_a_flag_of_run_clm_and_a_caveat_of_the_scripts_without_one(hermetic_home):
    from autotune import best

    with open_store() as store:
        for name, changes in (("clm", {}), ("s2s", {"task": "seq2seq", "target_length": 16})):
            study = make_study(store, name, environment=CPU)
            store.record_probe(
                study.id,
                config(4, precision="bf16", weights="bf16", **changes),
                result(),
                env_fingerprint=CPU.fingerprint(),
            )
    clm, s2s = best("clm"), best("s2s")
    # run_clm.py's flag is --dtype (--torch_dtype until transformers 4.56; its scripts now refuse that).
    assert "--bf16 --dtype bfloat16" in clm.cli_flags() and not any("bf16" in c for c in clm.cli_caveats())
    assert "--dtype" not in s2s.cli_flags()
    assert any(c.startswith("pure bf16 weights: run_summarization.py has no flag") for c in s2s.cli_caveats())


def test_the_speed_levers_are_flags_and_the_allocator_a_caveat(hermetic_home):
    # TrainingArguments refuses tf32 on CPU and Liger's kernels need CUDA: this winner is a GPU one,
    # its flags checked as text (each parsed by HfArgumentParser when this was written).
    from autotune import best

    with open_store() as store:
        study = make_study(store, "fast")
        store.record_probe(
            study.id,
            config(4, precision="tf32", compile=True, liger=True, allocator="expandable"),
            result(),
            env_fingerprint=ENV.fingerprint(),
        )
    chosen = best("fast")
    assert chosen.cli_flags().endswith("--optim adamw_torch_fused --tf32 true --torch_compile --use_liger_kernel")
    assert (
        "allocator expandable: start run_clm.py with PYTORCH_ALLOC_CONF=expandable_segments:True "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its environment"
    ) in "\n".join(chosen.cli_caveats())


def test_the_openmp_settings_the_probes_ran_under_are_part_of_every_hand_off(hermetic_home):
    # Stored with the study's environment as the probe's process had them; an environment recorded
    # before they were keeps its fingerprint (its stored probes stay reusable) and hands off none.
    import dataclasses

    from autotune import best
    from autotune.handoff import tools

    ran = dataclasses.replace(ENV, openmp=(("OMP_WAIT_POLICY", "PASSIVE"), ("OMP_NUM_THREADS", "4")))
    assert ENV.fingerprint() == Environment.from_dict({**ENV.to_dict(), "openmp": []}).fingerprint()
    assert (
        ran.fingerprint() != ENV.fingerprint() and Environment.from_dict(json.loads(json.dumps(ran.to_dict()))) == ran
    )
    with open_store() as store:
        study = make_study(store, "threads", environment=ran)
        store.record_probe(study.id, config(4), result(), env_fingerprint=ran.fingerprint())
        older = make_study(store, "older")
        store.record_probe(older.id, config(4), result(), env_fingerprint=ENV.fingerprint())
    chosen = best("threads")
    assert (
        chosen.environment()
        == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "4"}
        == chosen.to_dict()["environment"]
    )
    line = "the probes ran with OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=4"
    assert any(caveat.startswith(line) for caveat in chosen.cli_caveats())
    assert chosen.trainer_args_document()["environment"] == chosen.environment()
    for fmt in tools.TOOL_FORMATS:  # TRL, axolotl, LLaMA-Factory, Lightning: a note where only arguments travel
        assert any(note.startswith(line) for note in tools.notes(chosen, fmt)), fmt
    assert best("older").environment() == {} and "environment" not in best("older").trainer_args_document()
