"""`autotune train`: the real fine-tune with a study's winning configuration, run under the same
memory budget as the probes that chose it, so that finishing is the proof that it fits.

    from autotune.train import TrainOptions, train
    outcome = train(TrainOptions(dataset="corpus.txt", max_steps=1000), study="gpt2-8GiB")
    outcome.status, outcome.summary.peak_reserved_bytes, outcome.summary.tokens_per_s

The winner's levers go to `transformers.Trainer` (micro-batch, accumulation, fp16/bf16, gradient
checkpointing, the optimizer) and to the model (the task's class, attention implementation,
`use_cache=False`, pure bf16 weights, LoRA adapters: the adapter is saved, `--merge` also saves the
merged model); the
data becomes examples of the probe's shapes: blocks of the winner's block size for the language
models (`autotune.data`), padded sources and targets for seq2seq, padded texts and label ids for
classification (`autotune.data.task_data`). The budget holds as it does for a probe
(`autotune.probe.budget`): on CUDA the caching allocator is capped at budget - context - margin
before the model is built; on CPU the model is built and trained inside `CpuMemoryAccountant`,
which raises `torch.OutOfMemoryError` past the cap exactly where a card of that size would: it
watches the build, the first two optimizer steps (every later one repeats them) and each
evaluation, and the steps between run without it (it slows a step by about 40%), as a probe's
timed window does. The run is stored beside the probe that chose it, with its peaks and
throughput, and its `RunSummary` is written to autotune-run.json.

With an --eval-split the run evaluates as its probe measured (autotune.levers.evaluation: the eval batch,
loss only or logits kept for eval_accumulation_steps, Seq2SeqTrainer's generation), every
--save-steps and at its end, under the same cap; the evaluation flags go into the search that runs
first, and a settled study's evaluation decides (a flag may repeat it, not contradict it). Each
phase's peak is measured on its own and held against the probe's (`RunSummary.phases`).

Everything a user can get wrong (study, model, tokenizer, data, device, budget, output directory)
is checked before the run is recorded; an OOM during the run is an outcome (`status='oom'`), the
run marked failed and its checkpoints kept.

    winner     which study and configuration to train; a search first when none is settled
    loading    weights location, tokenizer, the model of the task built from them
    task_data  each task's columns, labels, examples and collator (as the HF example scripts)
    run        TrainingArguments, the run through transformers.Trainer, checkpoints, output dir
    meter      the Trainer callback timing steps and reading each phase's peaks, and the Trainers
               that tell it when an evaluation runs (imports transformers)
    summary    RunSummary, the typed record of a run, and its JSON form
    options    TrainOptions in, TrainOutcome out
    fine_tune  train(): the checks in order, then the recorded run

Importing this package does not import torch or transformers; a run does.
"""

from __future__ import annotations

from autotune.train.fine_tune import train
from autotune.data.tokenizer import load_tokenizer
from autotune.specs.models import WEIGHT_FILES
from autotune.train.loading import build_model, weights_location
from autotune.train.options import TrainOptions, TrainOutcome
from autotune.train.run import DEFAULT_OUTPUT_ROOT, checkpoints, default_output_dir
from autotune.train.summary import PEAK_TOLERANCE, SUMMARY_FILE, PhasePeak, ProbeMeasurement, RunSummary

__all__ = [
    "DEFAULT_OUTPUT_ROOT",
    "PEAK_TOLERANCE",
    "SUMMARY_FILE",
    "WEIGHT_FILES",
    "PhasePeak",
    "ProbeMeasurement",
    "RunSummary",
    "TrainOptions",
    "TrainOutcome",
    "build_model",
    "checkpoints",
    "default_output_dir",
    "load_tokenizer",
    "train",
    "weights_location",
]
