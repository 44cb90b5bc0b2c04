"""The hand-off of a study that measured the run's evaluation (autotune.levers.evaluation): TrainingArguments,
the example scripts' flags, yaml and `print(best)` carry the eval batch, what evaluation keeps and
seq2seq generation, read from a real study in the store; a study without evaluation hands off what
it always did; and a real Seq2SeqTrainer trains and generates with `best.training_arguments()`."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from autotune import best
from autotune.host.environment import Environment
from autotune.handoff import BestConfig, checkpointing_argument_names
from autotune.store import open_store
from tests.helpers.store import ENV, config, make_study, result
from tests.helpers.tiny_tasks import TINY

GiB = 2**30
CPU = Environment("cpu", "cpu: test", 8 * GiB, torch_version="2.13.0", transformers_version="5.23.0")
EVAL_FIELDS = {
    "per_device_eval_batch_size",
    "eval_accumulation_steps",
    "prediction_loss_only",
    "predict_with_generate",
    "generation_max_length",
    "generation_num_beams",
}


def stored_winner(name: str, environment: Environment = ENV, *, measured: dict | None = None, **fields) -> BestConfig:
    """`autotune.best(name)` of a study whose one probe (ok) is a config of `fields`, its result
    with the fields of `measured`."""
    with open_store() as store:
        study = make_study(store, name, environment=environment)
        store.record_probe(
            study.id, config(**fields), result(**(measured or {})), env_fingerprint=environment.fingerprint()
        )
    return best(name)


SEQ2SEQ = {
    "micro_batch": 4,
    "task": "seq2seq",
    "target_length": 64,
    "eval_batch": 8,
    "generation_max_length": 96,
    "generation_num_beams": 4,
}


@dataclasses.dataclass
class SummarizationData:
    """The data arguments of run_summarization.py that generation reads (defaults as the script has them)."""

    max_source_length: int = 1024
    max_target_length: int = 128
    val_max_target_length: int | None = None
    pad_to_max_length: bool = False
    num_beams: int | None = 1


def parse_as_run_summarization(flags: str):
    """The flags as run_summarization.py reads them: its HfArgumentParser, then its own overrides of
    the generation fields (val_max_target_length defaults to max_target_length; its num_beams, 1
    unless given, replaces generation_num_beams)."""
    from transformers import HfArgumentParser, Seq2SeqTrainingArguments

    args, data = HfArgumentParser((Seq2SeqTrainingArguments, SummarizationData)).parse_args_into_dataclasses(
        ["--output_dir", "unused", *shlex.split(flags)]
    )
    data.val_max_target_length = data.val_max_target_length or data.max_target_length
    args.generation_max_length = (
        args.generation_max_length if args.generation_max_length is not None else data.val_max_target_length
    )
    args.generation_num_beams = data.num_beams if data.num_beams is not None else args.generation_num_beams
    return args, data


def test_a_seq2seq_winner_that_generates_hands_off_generation_and_seq2seq_training_arguments(tmp_path):
    import transformers

    chosen = stored_winner("s2s", **SEQ2SEQ)
    kwargs = chosen.trainer_kwargs()
    # Loss-only with generation: the generated tokens are kept all the same, so they go to the host
    # every batch, as the probe kept one batch of them; prediction_loss_only would stop generation.
    assert {k: kwargs[k] for k in EVAL_FIELDS & set(kwargs)} == {
        "per_device_eval_batch_size": 8,
        "eval_accumulation_steps": 1,
        "predict_with_generate": True,
        "generation_max_length": 96,
        "generation_num_beams": 4,
    }
    args = chosen.training_arguments(output_dir=str(tmp_path / "out"))
    assert type(args) is transformers.Seq2SeqTrainingArguments
    assert (args.per_device_eval_batch_size, args.eval_accumulation_steps, args.prediction_loss_only) == (8, 1, False)
    assert (args.predict_with_generate, args.generation_max_length, args.generation_num_beams) == (True, 96, 4)

    document = json.loads(chosen.render("trainer-args"))
    assert (document["training_arguments_class"], document["trainer_class"]) == (
        "Seq2SeqTrainingArguments",
        "Seq2SeqTrainer",
    )
    built = getattr(transformers, document["training_arguments_class"])(
        output_dir=str(tmp_path / "o2"), **document["training_arguments"]
    )
    assert built.predict_with_generate and built.generation_num_beams == 4

    flags = chosen.cli_flags()
    assert (
        "--max_source_length 512 --max_target_length 64 --pad_to_max_length --per_device_eval_batch_size 8 "
        "--eval_accumulation_steps 1 --predict_with_generate --generation_max_length 96 --num_beams 4 --optim"
    ) in flags
    # --val_max_target_length would also pad the eval targets to 96, where the probe measured 64.
    assert "--val_max_target_length" not in flags and "--prediction_loss_only" not in flags
    parsed, data = parse_as_run_summarization(flags)
    assert (parsed.per_device_eval_batch_size, parsed.eval_accumulation_steps, parsed.predict_with_generate) == (
        8,
        1,
        True,
    )
    assert (parsed.generation_max_length, parsed.generation_num_beams, data.val_max_target_length) == (96, 4, 64)
    # Nothing of the evaluation is left unsaid; only the loss scaling a seq2seq model needs under
    # accumulation, which no flag of the script sets (handoff/loss_scaling.py).
    assert [caveat.split(":")[0] for caveat in chosen.cli_caveats()] == ["loss under accumulation"]

    yaml = chosen.yaml()
    assert 'training_arguments_class: "Seq2SeqTrainingArguments"' in yaml.splitlines()
    for line in (
        "  per_device_eval_batch_size: 8",
        "  eval_accumulation_steps: 1",
        "  predict_with_generate: true",
        "  generation_max_length: 96",
        "  generation_num_beams: 4",
    ):
        assert line in yaml.splitlines()
    assert chosen.row.label.endswith(" eval8 gen96x4")


def test_kept_logits_generation_moves_them_to_the_host_as_often_as_the_probe_kept_them():
    chosen = stored_winner("s2s-kept", **SEQ2SEQ, eval_logits="kept", eval_accumulation_steps=3)
    assert chosen.eval_kwargs()["eval_accumulation_steps"] == 3
    assert "--eval_accumulation_steps 3 --predict_with_generate" in chosen.cli_flags()


def test_a_causal_lm_winner_with_kept_logits_hands_off_its_accumulation_steps(tmp_path):
    import transformers

    chosen = stored_winner("clm-kept", eval_batch=16, eval_logits="kept", eval_accumulation_steps=2)
    kwargs = chosen.trainer_kwargs()
    assert {k: kwargs[k] for k in EVAL_FIELDS & set(kwargs)} == {
        "per_device_eval_batch_size": 16,
        "eval_accumulation_steps": 2,
    }
    assert chosen.training_arguments_class() == "TrainingArguments"
    args = chosen.training_arguments(output_dir=str(tmp_path / "out"))
    assert type(args) is transformers.TrainingArguments
    assert (args.per_device_eval_batch_size, args.eval_accumulation_steps, args.prediction_loss_only) == (16, 2, False)
    assert "training_arguments_class" not in json.loads(chosen.render("trainer-args"))
    assert "--block_size 512 --per_device_eval_batch_size 16 --eval_accumulation_steps 2 --optim" in chosen.cli_flags()
    assert not chosen.cli_caveats()


@pytest.mark.parametrize("task, script", [("causal-lm", "run_clm.py"), ("classification", "run_classification.py")])
def test_a_loss_only_winner_hands_off_prediction_loss_only_and_says_what_the_script_loses(tmp_path, task, script):
    fields = {"task": task, "num_labels": 3} if task == "classification" else {}
    chosen = stored_winner(f"loss-{task}", eval_batch=16, **fields)
    kwargs = chosen.trainer_kwargs()
    # With compute_metrics Trainer would keep every eval batch's logits on the card: not what was measured.
    assert {k: kwargs[k] for k in EVAL_FIELDS & set(kwargs)} == {
        "per_device_eval_batch_size": 16,
        "prediction_loss_only": True,
    }
    args = chosen.training_arguments(output_dir=str(tmp_path / "out"))
    assert args.prediction_loss_only and args.eval_accumulation_steps is None
    assert "--per_device_eval_batch_size 16 --prediction_loss_only --optim" in chosen.cli_flags()
    assert any(
        c.startswith(f"loss-only evaluation: --prediction_loss_only keeps {script}'s metrics")
        for c in chosen.cli_caveats()
    )
    assert "eval:      batch 16, loss only" in str(chosen)


def test_a_study_without_evaluation_hands_off_what_it_did_before_evaluation_was_a_lever(tmp_path):
    import transformers

    chosen = stored_winner("plain", task="seq2seq", target_length=16, checkpointing=True)
    flag, flag_kwargs = checkpointing_argument_names()
    assert chosen.trainer_kwargs() == {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "fp16": False,
        "bf16": False,
        "tf32": False,
        flag: True,
        "optim": "adamw_torch_fused",
        flag_kwargs: {"use_reentrant": False},
    }
    assert chosen.eval_kwargs() == {} and chosen.training_arguments_class() == "TrainingArguments"
    assert chosen.cli_flags() == (
        "--per_device_train_batch_size 4 --gradient_accumulation_steps 8 --max_source_length 512 --max_target_length 16 "
        "--pad_to_max_length --optim adamw_torch_fused --gradient_checkpointing --gradient_checkpointing_kwargs "
        '{"use_reentrant":false}'
    )
    assert [caveat.split(":")[0] for caveat in chosen.cli_caveats()] == ["loss under accumulation"]
    assert set(json.loads(chosen.render("trainer-args"))) == {
        "training_arguments",
        "model_kwargs",
        "block_size",
        "task",
        "auto_class",
        "example_script",
        "max_source_length",
        "max_target_length",
        "model_attributes",
        "notes",
    }
    args = chosen.training_arguments(output_dir=str(tmp_path / "out"))
    defaults = transformers.TrainingArguments(output_dir=str(tmp_path / "d"))
    assert type(args) is transformers.TrainingArguments
    assert (args.per_device_eval_batch_size, args.eval_accumulation_steps, args.prediction_loss_only) == (
        defaults.per_device_eval_batch_size,
        None,
        False,
    )
    text = str(chosen)
    assert "eval:" not in text and "phases:" not in text and "Seq2SeqTrainer" not in text
    assert [line.split(":")[0].strip() for line in text.splitlines()[1:8]] == [
        "model",
        "levers",
        "speed",
        "memory",
        "confirmed",
        "note",
        "hand-off",
    ]  # (note: the loss under accumulation)


def test_print_best_shows_the_evaluation_in_one_line_and_each_phase_peak(hermetic_home):
    MiB = 2**20
    peaks = {
        "train": {"allocated": 3 * GiB, "reserved": 4 * GiB},
        "eval": {"allocated": 3 * GiB, "reserved": 4 * GiB + 512 * MiB},
        "generate": {"allocated": 4 * GiB, "reserved": 5 * GiB},
    }
    text = str(
        stored_winner(
            "shown",
            measured={"phase_peaks": peaks},
            micro_batch=4,
            task="seq2seq",
            target_length=64,
            eval_batch=8,
            eval_logits="kept",
            eval_accumulation_steps=2,
            generation_max_length=64,
            generation_num_beams=4,
        )
    )
    lines = text.splitlines()
    assert lines[3] == (
        "  eval:      batch 8, logits kept (moved to the host every 2 batches), generate up to 64 tokens x 4 beams"
    )
    memory = next(i for i, line in enumerate(lines) if line.startswith("  memory:"))
    assert lines[memory + 1] == "  phases:    peak reserved: train 4.00 GiB, eval 4.50 GiB, generate 5.00 GiB"
    assert (
        'args = best.training_arguments(output_dir="out")  # Seq2SeqTrainingArguments: train with Seq2SeqTrainer'
        in text
    )
    greedy = str(
        stored_winner("greedy", micro_batch=4, task="seq2seq", target_length=64, eval_batch=8, generation_max_length=32)
    )
    assert "  eval:      batch 8, generate up to 32 tokens x 1 beam (tokens moved to the host every batch)" in greedy
    assert "phases:" not in greedy  # no peaks stored for its phases


def test_an_eval_batch_the_probe_found_is_the_one_handed_off():
    # --eval-batch auto: the config holds the largest batch to try, the probe the largest that fitted.
    chosen = stored_winner("auto", measured={"eval_batch_found": 16}, eval_batch=64, auto_eval_batch=True)
    assert chosen.eval_batch == 16 and chosen.trainer_kwargs()["per_device_eval_batch_size"] == 16
    assert "--per_device_eval_batch_size 16 --prediction_loss_only" in chosen.cli_flags()
    assert "  eval:      batch 16 (the largest up to 64 that fits), loss only" in str(chosen)


class _Recorded:
    """What the model's `generate` was asked and gave, as Seq2SeqTrainer's prediction step calls it."""

    def __init__(self, model):
        self.calls: list[tuple[dict, tuple[int, ...]]] = []
        self.generate = model.generate

    def __call__(self, *args, **kwargs):
        tokens = self.generate(*args, **kwargs)
        self.calls.append((kwargs, tuple(tokens.shape)))
        return tokens


@pytest.mark.slow
def test_a_real_seq2seq_trainer_trains_and_generates_with_the_handed_off_arguments(tmp_path):
    import torch
    import transformers

    from autotune.levers.tasks import AUTO_CLASSES, Task

    source, target, length, beams = 16, 8, 12, 2
    chosen = stored_winner(
        "t5",
        CPU,
        model="t5",
        micro_batch=2,
        grad_accum=2,
        block_size=source,
        task="seq2seq",
        target_length=target,
        eval_batch=4,
        generation_max_length=length,
        generation_num_beams=beams,
    )
    # The hand-off's object as it is, output_dir alone given: Trainer's 3 epochs of 4 pairs are 3 optimizer steps.
    args = chosen.training_arguments(output_dir=str(tmp_path / "out"))
    assert type(args) is transformers.Seq2SeqTrainingArguments and args.use_cpu

    fields = dict(TINY["t5"])
    torch.manual_seed(0)
    model = chosen.load_model(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert (
        type(model).__name__ == "T5ForConditionalGeneration" and AUTO_CLASSES[Task.SEQ2SEQ] == "AutoModelForSeq2SeqLM"
    )
    model.generate = _Recorded(model)
    # Full-length token ids, as the probes' batches and --pad_to_max_length are: no tokenizer needed.
    generator = torch.Generator().manual_seed(0)

    def pairs(count: int) -> list[dict]:
        return [
            {
                "input_ids": torch.randint(2, 1024, (source,), generator=generator).tolist(),
                "attention_mask": [1] * source,
                "labels": torch.randint(2, 1024, (target,), generator=generator).tolist(),
            }
            for _ in range(count)
        ]

    def collate(features: list[dict]) -> dict:
        return {name: torch.tensor([f[name] for f in features]) for name in features[0]}

    predictions = []

    def compute_metrics(prediction) -> dict:
        # run_summarization.py passes one with predict_with_generate: without it evaluate() keeps the loss alone.
        predictions.append(prediction.predictions)
        return {"generated": float(prediction.predictions.shape[0])}

    trainer = transformers.Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=pairs(4),
        eval_dataset=pairs(8),
        data_collator=collate,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    assert trainer.state.global_step == 3
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] > 0 and metrics["eval_generated"] == 8
    # Each eval batch of the handed-off size generated to the handed-off length with its beams.
    assert [shape for _, shape in model.generate.calls] == [(4, length), (4, length)]
    assert all(kwargs["max_length"] == length and kwargs["num_beams"] == beams for kwargs, _ in model.generate.calls)
    # Trainer pads what it keeps to at least that length (the model's generation_config.max_length, 20, is longer here).
    assert predictions[0].shape[0] == 8 and predictions[0].shape[1] >= length
