"""`search --from FILE` and `best --update FILE`: a user's own TRL, axolotl, LLaMA-Factory or
TrainingArguments file read for its recipe, searched, and written back with only the decided keys
changed, comments kept. Two real CPU searches on a tiny GPT-2 serve the round trips: one LoRA recipe
that the axolotl, LLaMA-Factory and TRL files all state (the second and third `--from` find the
first's finished study: the same recipe, read from three tools' keys), one full fine-tune that an
SFTConfig JSON and a TrainingArguments JSON state. Bad files are one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from autotune.vocabulary.errors import BadInput
from autotune.handoff.tools import LLAMAFACTORY_ATTENTION
from autotune.recipe_files import read_recipe_file
from autotune.recipe_files.write_back import DECIDED
from autotune.recipe_files.yaml_edit import edit
from tests.helpers.cli import assert_usage_error, invoke
from tests.helpers.models import write_model_dir
from tests.helpers.runners import commands_probe_with

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_positions": 128}
SEARCH = [
    "--gpu-budget",
    "300MiB",
    "--device",
    "cpu",
    "--precisions",
    "fp32",
    "--attention",
    "sdpa,eager",
    "--checkpointing",
    "off,on",
    "--measure-seconds",
    "0.2",
    "--warmup-steps",
    "2",
    "--measure-steps",
    "2",
    "--no-predict",
    "--no-confirm",
    "--json",
]

AXOLOTL = """\
# A LoRA fine-tune of a tiny GPT-2 (axolotl)
base_model: {model}   # the team's base
model_type: AutoModelForCausalLM

datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
val_set_size: 0.0
output_dir: ./outputs/lora-out

sequence_len: 64
sample_packing: true
pad_to_sequence_len: true

adapter: lora
lora_r: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true

gradient_accumulation_steps: 4  # the team's effective batch is 8
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_torch
learning_rate: 0.0002

bf16: auto
tf32: false
gradient_checkpointing: true
flash_attention: true  # our A100s
"""

LLAMAFACTORY = """\
### model
model_name_or_path: {model}
trust_remote_code: false

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 64  # our prompts are short
max_samples: 1000
preprocessing_num_workers: 16

### output
output_dir: saves/tiny/lora/sft
logging_steps: 10
plot_loss: true

### train
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
bf16: true
optim: adamw_torch
"""

TRL_YAML = """\
# trl sft --config sft.yaml
model_name_or_path: {model}
dataset_name: trl-lib/Capybara
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: all-linear
max_length: 64
per_device_train_batch_size: 8
gradient_accumulation_steps: 1
optim: adamw_torch
gradient_checkpointing: true
output_dir: Qwen-SFT
"""

SFT_CONFIG = {
    "output_dir": "out",
    "max_length": 64,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "learning_rate": 2e-5,
    "num_train_epochs": 1,
    "optim": "adamw_torch",
    "gradient_checkpointing": True,
    "packing": True,
    "logging_steps": 5,
    "report_to": "none",
}
TRAINING_ARGUMENTS = {
    "output_dir": "out",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "optim": "adamw_torch",
    "fp16": False,
    "save_strategy": "no",
}


@pytest.fixture(scope="module")
def work(tmp_path_factory, probe_runner):
    base = tmp_path_factory.mktemp("recipes")
    return {
        "base": base,
        "model": str(write_model_dir(base / "tiny", **TINY)),
        "db": f"sqlite:///{base / 'r.db'}",
        "runner": probe_runner,
    }


def write(work, name: str, text: str) -> Path:
    path = work["base"] / name
    path.write_text(text.format(model=work["model"]) if "{model}" in text else text)
    return path


def search(work, *args: str, flags: list[str] = SEARCH) -> dict:
    """The search in this process, with the test worker's warm probe child (what is read from the
    files is the subject, not the search's process)."""
    with commands_probe_with(work["runner"]):
        done = invoke("search", *args, *flags, "--db", work["db"])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def diffed_keys(diff: str) -> set[str]:
    """The top-level keys of the lines a unified diff removes or adds (the file's own keys)."""
    keys = set()
    for line in diff.splitlines():
        if line[:1] in "+-" and not line.startswith(("---", "+++")):
            if match := re.match(r'^[+-]\s*"?([A-Za-z_][\w.-]*)"?\s*:', line):
                keys.add(match.group(1))
    return keys


def update(work, study: str, path: Path) -> tuple[str, Path]:
    """`best --update` in this process (the file written is the subject, not a second interpreter)."""
    out = path.with_name("tuned-" + path.name)
    done = invoke("best", "--study", study, "--update", str(path), "--out", str(out), "--db", work["db"])
    assert done.returncode == 0, done.stderr
    return done.stdout, out


@pytest.fixture(scope="module")
def lora_study(work):
    """One LoRA search from the axolotl file; LLaMA-Factory's and TRL's files state the same recipe."""
    summary = search(work, "--from", str(write(work, "axolotl.yml", AXOLOTL)))
    return summary


@pytest.mark.slow
def test_three_tools_files_state_one_recipe_and_get_the_winner_back_with_comments(work, lora_study):
    study, best = lora_study["study"], lora_study["best"]
    assert lora_study["status"] == "finished" and best["micro_batch"] * best["grad_accum"] == 8
    assert best["peft"].startswith("lora r=8 alpha=16 dropout=0.05 targets=all-linear")
    again = search(work, "--from", str(write(work, "llamafactory.yml", LLAMAFACTORY)))
    assert again["study"] == study and again["best"]["label"] == best["label"]  # the same recipe: nothing probed again
    # TRL's file states it too, but its SFTTrainer takes another step (TRL's fused LM head): the
    # search times that step, in a study of its own; the Trainer's study handed to TRL says so.
    sft = write(work, "sft.yml", TRL_YAML)
    refused = invoke("search", "--from", str(sft), *SEARCH, "--db", work["db"])
    assert refused.returncode == 2 and "targets=all-linear, not task" in refused.stderr
    assert "targets=all-linear, trainer trl: its leaderboard would mix" in refused.stderr
    trl_study = search(work, "--from", str(sft), "--study", "tiny-trl")
    assert trl_study["best"]["trainer"] == "trl" and trl_study["best"]["label"].endswith(" trl")
    warned = invoke("best", "--study", study, "--format", "trl", "--db", work["db"])
    assert warned.returncode == 0 and "warning: the probes timed transformers' Trainer step" in warned.stderr
    for name, tool, measured in (
        ("axolotl.yml", "axolotl", study),
        ("llamafactory.yml", "llamafactory", study),
        ("sft.yml", "trl", "tiny-trl"),
    ):
        path = work["base"] / name
        diff, out = update(work, measured, path)
        before, after = yaml.safe_load(path.read_text()), yaml.safe_load(out.read_text())
        assert diffed_keys(diff) <= set(DECIDED[tool]) | {
            "flash_attention",
            "attn_implementation",
            "gradient_checkpointing",
        }
        assert {
            k: v
            for k, v in after.items()
            if k not in DECIDED[tool] and k not in ("flash_attention", "attn_implementation", "gradient_checkpointing")
        } == {
            k: v
            for k, v in before.items()
            if k not in DECIDED[tool] and k not in ("flash_attention", "attn_implementation", "gradient_checkpointing")
        }
        comments = [line.strip() for line in path.read_text().splitlines() if "#" in line]
        kept = out.read_text()
        assert all(comment.split("#", 1)[1] in kept for comment in comments), f"{name}: a comment was lost"
        assert read_recipe_file(out).effective_batch == 8 == read_recipe_file(path).effective_batch
    axolotl = yaml.safe_load((work["base"] / "tuned-axolotl.yml").read_text())
    assert (
        axolotl["micro_batch_size"] == best["micro_batch"]
        and axolotl["gradient_accumulation_steps"] == best["grad_accum"]
    )
    assert axolotl["attn_implementation"] == best["attention"] and "flash_attention" not in axolotl
    assert axolotl["gradient_checkpointing"] == best["checkpointing"]
    factory = yaml.safe_load((work["base"] / "tuned-llamafactory.yml").read_text())
    assert factory["per_device_train_batch_size"] == best["micro_batch"]
    assert factory["disable_gradient_checkpointing"] == (not best["checkpointing"])
    assert factory["bf16"] is False  # the CPU study measured fp32: the file's bf16 is what it decided
    trl = yaml.safe_load((work["base"] / "tuned-sft.yml").read_text())
    trl_best = trl_study["best"]  # (TRL's step, timed: its pick may differ from Trainer's)
    assert trl["attn_implementation"] == trl_best["attention"]
    assert trl["gradient_checkpointing"] == trl_best["checkpointing"]


TRL_PACKING = """\
# trl sft --config sft.yaml: the examples {how}
model_name_or_path: {{model}}
max_length: 64
per_device_train_batch_size: 8
gradient_accumulation_steps: 1
optim: adamw_torch
{packing}output_dir: out
"""


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True, "padding-free"])
def test_a_trl_file_with_packing_or_without_is_searched_as_it_trains_and_written_back(work, packing):
    """TRL's default (no `packing` key) pads each example to its batch's longest: searched on the
    data's lengths (--dataset), ranked by real tokens, written back with `packing: false`; `packing:
    true` is full blocks, written back as such. The packing key is the file's: never changed."""
    from tests.helpers.corpus import write_task_tokenizer

    words = "the quick brown fox jumps over the lazy dog and runs far away from the farm".split()
    data = work["base"] / f"sft-{packing}.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(words[: n % 15 + 1] * (1 + 3 * (n % 7 == 0)))}) + "\n" for n in range(60))
    )
    tokenizer = work["base"] / "words"
    if not tokenizer.exists():
        tokenizer.mkdir()
        write_task_tokenizer(" ".join(words), tokenizer, vocab_size=60, mask=False)
    path = write(
        work,
        f"sft-packing-{packing}.yml",
        TRL_PACKING.format(
            how="packed into full blocks" if packing else "one per row (TRL's default)",
            packing={True: "packing: true\n", False: "", "padding-free": "padding_free: true\n"}[packing],
        ),
    )
    study = f"trl-packing-{packing}"
    # (one attention kernel, no checkpointing: the subject is the file's packing, not the levers)
    fewer = [flag if flag not in ("sdpa,eager", "off,on") else flag.split(",")[0] for flag in SEARCH]
    summary = search(
        work,
        "--from",
        str(path),
        "--dataset",
        str(data),
        "--tokenizer",
        str(tokenizer),
        "--study",
        study,
        "--micro-batches",
        "2,8",
        flags=fewer,
    )
    best = summary["best"]
    assert best["trainer"] == "trl" and best["micro_batch"] * best["grad_accum"] == 8
    if packing == "padding-free":  # (TRL's padding_free, read from the file: each micro-batch end to end)
        assert best["padding_free"] and best["lengths"].startswith("q") and best["padding_share"] == 0.0
    elif packing:
        assert best["lengths"] is None and best["padding_share"] is None and best["block_size"] == 64
    else:
        assert best["lengths"].startswith("q") and best["block_size"] <= 64  # (capped at the longest example)
        assert {row["micro_batch"]: row["padding_share"] > 0 for row in summary["leaderboard"]} == {2: True, 8: True}
    diff, out = update(work, study, path)
    tuned = yaml.safe_load(out.read_text())
    assert tuned["per_device_train_batch_size"] == best["micro_batch"]
    flat = packing == "padding-free"
    if flat:  # written back as SFTTrainer takes it: no max_length beside padding_free
        assert tuned["padding_free"] is True and tuned["max_length"] is None and "packing" not in tuned
        packing = False  # (and otherwise as the per-example file)
    assert ("packing" in tuned) == packing and tuned.get("packing", False) is packing
    assert "packing" not in diffed_keys(diff)
    if not packing:  # the study is of its data's lengths: not resumed without them
        again = invoke("search", "--from", str(path), "--study", study, *SEARCH, "--db", work["db"])
        said = (
            "--padding-free on puts each micro-batch's examples" if flat else "give the same --dataset (and --packing)"
        )
        assert again.returncode == 2 and said in again.stderr, again.stderr
    if not packing:  # a file asking for packing cannot take the per-example study's winner
        packed = write(work, "sft-now-packed.yml", TRL_PACKING.format(how="packed", packing="packing: true\n"))
        refused = invoke("best", "--study", study, "--update", str(packed), "--db", work["db"])
        assert refused.returncode == 2 and "asks packing on" in refused.stderr


@pytest.mark.slow
def test_an_sft_config_json_and_training_arguments_json_round_trip_through_their_own_classes(work):
    trl = pytest.importorskip("trl")
    import transformers

    sft = write(work, "sft.json", json.dumps(SFT_CONFIG, indent=4) + "\n")
    summary = search(work, "--from", str(sft), "--model", work["model"], "--study", "full")
    best = summary["best"]
    assert best["micro_batch"] * best["grad_accum"] == 4 and best.get("peft") is None
    diff, out = update(work, "full", sft)
    written = json.loads(out.read_text())
    assert diff.startswith(f"--- {sft}\n+++ {out}\n")
    changed = {
        k for k in {*written, *SFT_CONFIG} if written.get(k) != SFT_CONFIG.get(k)
    }  # (JSON's commas move: by value)
    assert changed <= set(DECIDED["trl"]) | {
        "gradient_checkpointing",
        "model_init_kwargs",
        "attn_implementation",
        "activation_checkpointing",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing_kwargs",
    }
    assert {
        k: v for k, v in written.items() if k in SFT_CONFIG and k not in DECIDED["trl"] and "checkpointing" not in k
    } == {k: v for k, v in SFT_CONFIG.items() if k not in DECIDED["trl"] and "checkpointing" not in k}
    assert out.read_text().startswith('{\n    "output_dir"')  # its indent and key order kept
    config = trl.SFTConfig(**written)  # TRL's own class takes the file as written
    assert config.per_device_train_batch_size == best["micro_batch"] and config.max_length == 64
    assert written["model_init_kwargs"]["attn_implementation"] == best["attention"]
    # A TrainingArguments JSON with the same recipe: the same study's winner, in TrainingArguments' own class.
    plain = write(work, "args.json", json.dumps(TRAINING_ARGUMENTS) + "\n")
    _, out = update(work, "full", plain)
    arguments = transformers.TrainingArguments(**json.loads(out.read_text()))
    assert arguments.per_device_train_batch_size * arguments.gradient_accumulation_steps == 4


@pytest.mark.parametrize(
    "text, needle",
    [
        ("foo: 1\n", "none of the keys of a TRL, axolotl, LLaMA-Factory or TrainingArguments config"),
        ("- a\n- b\n", "is a list, not a mapping"),
        ("base_model: [unclosed\n", "not valid YAML"),
        (
            "base_model: gpt2\nmicro_batch_size: 2\ngradient_accumulation_steps: 4\nbatch_size: 16\n",
            "batch_size: 16 contradicts micro_batch_size x gradient_accumulation_steps = 2 x 4 = 8",
        ),
        ("base_model: gpt2\nadapter: ia3\n", "adapter: 'ia3': autotune measures LoRA and QLoRA"),
        ("model_name_or_path: gpt2\nstage: dpo\n", "stage: 'dpo'"),
        ("model_name_or_path: gpt2\nstage: sft\nquantization_bit: 8\n", "quantization_bit: 8"),
        ("trainer:\n  max_epochs: 1\nmodel:\n  lr: 0.1\n", "a LightningCLI config"),
        ("base_model: gpt2\noptimizer: lion_8bit\n", "optimizer: 'lion_8bit'"),
        ("base_model: gpt2\nmicro_batch_size: 0\n", "micro_batch_size: 0 is not a whole number"),
    ],
)
def test_a_file_autotune_cannot_use_is_one_line_and_nothing_written(tmp_path, hermetic_home, text, needle):
    path = tmp_path / "recipe.yml"
    path.write_text(text)
    with pytest.raises(BadInput, match=re.escape(needle)):
        read_recipe_file(path)
    before = sorted(hermetic_home.rglob("*"))
    assert_usage_error(invoke("search", "--from", str(path), "--gpu-budget", "1GiB"), needle)
    assert sorted(hermetic_home.rglob("*")) == before and path.read_text() == text


def test_a_flag_that_contradicts_the_file_is_refused_and_one_that_agrees_is_taken(tmp_path, hermetic_home, work):
    path = write(work, "flags.yml", AXOLOTL)
    assert_usage_error(
        invoke("search", "--from", str(path), "--gpu-budget", "1GiB", "--effective-batch", "16"),
        "--effective-batch 16 contradicts flags.yml's micro_batch_size x gradient_accumulation_steps (8)",
    )
    assert_usage_error(
        invoke("search", "--from", str(path), "--gpu-budget", "1GiB", "--model", "gpt2"),
        "--model gpt2 contradicts flags.yml's base_model",
    )
    assert_usage_error(invoke("search", "--from", str(tmp_path / "nope.yml"), "--gpu-budget", "1GiB"), "no such file")
    assert_usage_error(invoke("search", "--gpu-budget", "1GiB"), "--model: give the model to search")
    assert not list(hermetic_home.rglob("*.db"))
    # --dry-run prints the job script from the file's recipe: the flags it read, as if typed.
    done = invoke(
        "search",
        "--from",
        str(path),
        "--gpu-budget",
        "1GiB",
        "--effective-batch",
        "8",
        "--launcher",
        "slurm",
        "--dry-run",
        "--device",
        "cpu",
    )
    assert done.returncode == 0, done.stderr
    assert (
        "the recipe of axolotl's" in done.stderr
        and "--peft lora" in done.stderr
        and "--effective-batch 8" in done.stderr
    )


@pytest.mark.slow
def test_update_refuses_a_file_of_another_recipe_and_leaves_it_as_it_was(work, lora_study):
    other = write(work, "other.yml", AXOLOTL.replace("micro_batch_size: 2", "micro_batch_size: 4"))
    text = other.read_text()
    done = invoke("best", "--study", lora_study["study"], "--update", str(other), "--db", work["db"])
    assert_usage_error(done, "asks an effective batch 16, and study")
    assert other.read_text() == text and not (work["base"] / "tuned-other.yml").exists()
    assert_usage_error(invoke("best", "--out", str(other), "--db", work["db"]), "--out goes with --update")
    assert_usage_error(
        invoke("best", "--study", lora_study["study"], "--update", str(work["base"] / "nope.yml"), "--db", work["db"]),
        "--update " + str(work["base"] / "nope.yml") + ": no such file",
    )


def test_the_yaml_edit_keeps_comments_and_order_and_refuses_what_it_cannot_place():
    text = "# top\na: 1  # one\nb:\n  c: 2\n\n# about d\nd: x\nlist:\n- 1\n- 2\n"
    out = edit(text, {"a": 3, "b": {"c": 4, "e": True}, "f": "no"}, ("d",), appended_note="added")
    assert out.startswith("# top\na: 3  # one\nb:\n  c: 4\n  e: true\n\n# about d\nlist:\n- 1\n- 2\n")
    assert out.endswith('# added\nf: "no"\n') and yaml.safe_load(out)["f"] == "no"
    # A nested block broken by a comment at column 0: its lines cannot be placed, and nothing is returned.
    for text in ("b:\n  c: 2\n# note\n  d: 3\n", "b:\n  c: 2\n# note\n  d: 3\ne: 1\n"):
        with pytest.raises(ValueError, match="does not read back"):
            edit(text, {"b": 5})


def test_defaults_of_each_tool_are_the_recipe_when_the_file_leaves_them_out(tmp_path):
    factory = tmp_path / "lf.yml"
    factory.write_text("model_name_or_path: gpt2\nstage: sft\nlora_rank: 16\n")
    flags = read_recipe_file(factory).flags
    # LLaMA-Factory: LoRA by default, alpha = 2 x rank, dropout 0, all linear, cutoff_len 2048, TrainingArguments' batch 8.
    assert (flags["peft"], flags["lora_alpha"], flags["lora_dropout"], flags["lora_targets"]) == (
        "lora",
        "32",
        "0.0",
        "all-linear",
    )
    assert (flags["block_sizes"], flags["effective_batch"], flags["optimizers"]) == ("2048", "8", "adamw")
    assert read_recipe_file(factory).said == ()  # (its default targets are all linear layers: nothing to say)
    axolotl = tmp_path / "a.yml"
    axolotl.write_text(
        "base_model: gpt2\nadapter: qlora\nload_in_4bit: true\nlora_target_modules: [q_proj, v_proj]\n"
        "val_set_size: 0.05\ndeepspeed: zero3.json\n"
    )
    read = read_recipe_file(axolotl, gpus=2)
    assert (read.flags["peft"], read.flags["lora_targets"], read.flags["block_sizes"]) == (
        "qlora",
        "q_proj,v_proj",
        "512",
    )
    assert read.flags["effective_batch"] == "2" and read.flags["eval_batch"] == "auto"  # 1 x 1 x 2 GPUs
    assert len(read.said) == 1 and "DeepSpeed" in read.said[0]
    trl = tmp_path / "trl.yml"
    trl.write_text("model_name_or_path: gpt2\nuse_peft: true\nmax_length: 256\n")
    read = read_recipe_file(trl)
    assert (read.flags["lora_rank"], read.flags["lora_alpha"], read.flags["lora_targets"]) == ("16", "32", "all-linear")
    assert len(read.said) == 1 and "lora_target_modules is not given" in read.said[0]
    shutil.rmtree(tmp_path)


# The tools whose pins conflict with autotune's environment (LLaMA-Factory: transformers and datasets
# below autotune's; axolotl: transformers==5.16.1) live in a Python of their own (`python -m venv v &&
# v/bin/pip install llamafactory`, or axolotl), named by these variables; each one's own parser
# reads the file written back and prints what it read.
TOOL_PYTHON = {"llamafactory": "AUTOTUNE_LLAMAFACTORY_PYTHON", "axolotl": "AUTOTUNE_AXOLOTL_PYTHON"}
TOOL_PARSE = {
    "llamafactory": """
import sys, yaml
from llamafactory.hparams import get_train_args
model, data, training, finetuning, _ = get_train_args(yaml.safe_load(open(sys.argv[1])))
print(training.per_device_train_batch_size, training.gradient_accumulation_steps, data.cutoff_len,
      not model.disable_gradient_checkpointing, model.flash_attn, finetuning.finetuning_type, finetuning.lora_rank)
""",
    "axolotl": """
import sys, yaml
from axolotl.utils.config import validate_config
from axolotl.utils.dict import DictDefault
cfg = validate_config(DictDefault(yaml.safe_load(open(sys.argv[1]))), env_capabilities={"torch_version": "2.13.0"},
                      capabilities={"bf16": False, "fp8": False, "n_gpu": 1, "compute_capability": None})
print(cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.sequence_len, bool(cfg.gradient_checkpointing),
      cfg.attn_implementation, cfg.adapter, cfg.lora_r)
""",
}
TOOL_FILES = {
    "llamafactory": (
        "lf-parse.yml",
        LLAMAFACTORY.replace("dataset: identity,alpaca_en_demo", "dataset: identity").replace(
            "template: llama3", "template: default"
        ),
    ),
    "axolotl": ("ax-parse.yml", AXOLOTL),
}


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOL_PYTHON))
def test_the_tool_s_own_parser_takes_the_file_written_back(work, request, tool):
    import os
    import subprocess

    python = os.environ.get(TOOL_PYTHON[tool])
    if not python:
        pytest.skip(
            f"set {TOOL_PYTHON[tool]} to a Python with {tool} installed (its pins conflict with autotune's environment)"
        )
    lora_study = request.getfixturevalue("lora_study")  # (searched only where the tool is there to read it)
    path = write(work, *TOOL_FILES[tool])
    _, out = update(work, lora_study["study"], path)
    done = subprocess.run(
        [python, "-c", TOOL_PARSE[tool], str(out)], capture_output=True, text=True, timeout=300, cwd=work["base"]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    best = lora_study["best"]
    micro, accum, length, checkpointing, attention, kind, rank = done.stdout.split()[-7:]
    assert (int(micro), int(accum), int(length)) == (best["micro_batch"], best["grad_accum"], 64)
    assert (checkpointing == "True") == best["checkpointing"] and kind == "lora" and rank == "8"
    expected = LLAMAFACTORY_ATTENTION[best["attention"]] if tool == "llamafactory" else best["attention"]
    assert attention.lower().endswith(expected)  # (LLaMA-Factory's name for eager is "disabled")


def _writable_copy(work, tmp_path, name: str, *, crlf: bool = False):
    text = AXOLOTL.format(model=work["model"])
    path = tmp_path / name
    path.write_bytes((text.replace("\n", "\r\n") if crlf else text).encode())
    return path


@pytest.mark.slow
def test_update_writes_through_a_link_to_its_file_says_so_and_keeps_crlf(work, lora_study, tmp_path):
    real = _writable_copy(work, tmp_path, "real.yml", crlf=True)
    before = real.read_bytes()
    link = tmp_path / "link.yml"
    link.symlink_to(real)
    done = invoke("best", "--study", lora_study["study"], "--update", str(link), "--db", work["db"])
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and f"wrote {link} (-> {real})" in done.stderr
    data = real.read_bytes()
    assert data != before and data.count(b"\n") == data.count(b"\r\n")  # changed, every line still CRLF


@pytest.mark.slow
def test_update_refuses_what_is_not_a_writable_regular_file_before_writing(work, lora_study, tmp_path):
    source = _writable_copy(work, tmp_path, "recipe.yml")
    fifo = tmp_path / "fifo.yml"
    os.mkfifo(fifo)
    read_only = _writable_copy(work, tmp_path, "read-only.yml")
    read_only.chmod(0o444)
    cases = [(["--update", str(source), "--out", str(fifo)], "a FIFO (named pipe), not a file")]
    cases.append((["--update", str(read_only)], "the file is read-only"))
    try:
        device = tmp_path / "null-device"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        cases.append((["--update", str(source), "--out", str(device)], "a character device, not a file"))
    except PermissionError:
        device = None  # (making a device node needs CAP_MKNOD: the FIFO case still runs)
    for args, needle in cases:
        assert_usage_error(invoke("best", "--study", lora_study["study"], *args, "--db", work["db"]), needle)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and read_only.read_text() == source.read_text()
    assert device is None or stat.S_ISCHR(device.stat().st_mode)


@pytest.mark.slow
def test_update_makes_a_new_file_as_the_umask_says_and_rewrites_nothing_already_decided(work, lora_study, tmp_path):
    source = _writable_copy(work, tmp_path, "recipe.yml")
    out = tmp_path / "tuned.yml"
    previous = os.umask(0o022)
    try:
        done = invoke(
            "best", "--study", lora_study["study"], "--update", str(source), "--out", str(out), "--db", work["db"]
        )
    finally:
        os.umask(previous)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # (a temporary file's 0600 was kept before)
    # The file says in itself what set its keys and where that was measured (a CPU study here),
    # beside comments of the user's that described the old values (before: only a stderr note).
    header, *rest = out.read_text().splitlines()
    # (which keys it sets depends on which config won, which depends on the CPU's timings: the header
    # names each key whose value the update changed, whatever won; the file's micro_batch_size 2 is
    # a candidate's, so that key is not always among them)
    before, after = yaml.safe_load(source.read_text()), yaml.safe_load(out.read_text())
    changed = {key for key in set(before) | set(after) if before.get(key) != after.get(key)}
    assert header.startswith("# autotune best --update: ") and changed
    assert all(key in header for key in changed), (changed, header)
    assert f"set by study {lora_study['study']!r}, measured on cpu" in header and "search on the card" in header
    assert rest == [line for line in rest if not line.startswith("# autotune best --update: ")]
    before = (out.read_bytes(), out.stat().st_mtime_ns)
    again = invoke("best", "--study", lora_study["study"], "--update", str(out), "--db", work["db"])
    assert again.returncode == 0, again.stderr
    assert "already has the winner's levers; nothing written" in again.stdout and "wrote" not in again.stderr
    assert (out.read_bytes(), out.stat().st_mtime_ns) == before


def test_a_quoted_key_is_written_in_its_place_not_added_again():
    # Before: the quoted key kept its old value and a second, plain one was appended (two values of
    # one key: the file no longer said one thing, and autotune's own reader now refuses it).
    text = "\"micro_batch_size\": 2  # ours\nother: 1\n'gradient_accumulation_steps': 4\n"
    edited = edit(text, {"micro_batch_size": 8, "gradient_accumulation_steps": 1}, ())
    assert edited == "micro_batch_size: 8  # ours\nother: 1\ngradient_accumulation_steps: 1\n"
