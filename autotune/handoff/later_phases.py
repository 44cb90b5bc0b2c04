"""The run's evaluation handed off (autotune.levers.evaluation): TrainingArguments' evaluation fields as the
winner's probe measured them, the example scripts' flags for them, and what `print(best)` says of
them. A study without evaluation has none of them: Trainer's defaults, as before evaluation was a
lever."""

from __future__ import annotations

from autotune.levers import evaluation
from autotune.levers.tasks import Task


def eval_kwargs(config, eval_batch: int | None) -> dict:
    """TrainingArguments' evaluation fields, so that the run's evaluation holds on the card what its
    probe measured ({} without evaluation). `eval_batch`: the run's (a found one for --eval-batch auto).

    What Trainer keeps of an eval batch is the hand-off's to pin down, not the user's Trainer's:
    `Trainer.evaluate` keeps only the loss when it has no `compute_metrics`, but with one (the
    example scripts all pass one) it keeps every batch's logits, on the card until
    `eval_accumulation_steps` moves them to the host (never, unset): memory a loss-only probe never
    measured. So a loss-only winner hands off `prediction_loss_only=True` (the run keeps the loss
    whatever it is given; its compute_metrics is not called), a kept-logits winner the
    `eval_accumulation_steps` its probe held. Generation cannot be loss-only (Seq2SeqTrainer
    generates only when predictions are kept): it keeps the generated tokens and the labels, which
    `eval_accumulation_steps` moves to the host every batch for a loss-only winner, as its probe kept
    one batch of them (a kept-logits winner's steps hold more: its probe kept their logits)."""
    if not evaluation.evaluates(config):
        return {}
    kwargs: dict = {"per_device_eval_batch_size": eval_batch}
    kept = config.eval_logits == evaluation.KEPT
    if evaluation.generates(config):
        kwargs.update(
            eval_accumulation_steps=config.eval_accumulation_steps if kept else 1,
            predict_with_generate=True,
            generation_max_length=config.generation_max_length,
            generation_num_beams=config.generation_num_beams,
        )
    elif kept:
        kwargs["eval_accumulation_steps"] = config.eval_accumulation_steps
    else:
        kwargs["prediction_loss_only"] = True
    return kwargs


def arguments_class(config) -> str:
    """The transformers class that takes the hand-off's TrainingArguments kwargs: Seq2SeqTrainingArguments
    where the run generates (predict_with_generate and the generation fields are its own; a
    Seq2SeqTrainer reads them), TrainingArguments otherwise."""
    return "Seq2SeqTrainingArguments" if evaluation.generates(config) else "TrainingArguments"


def eval_flags(kwargs: dict) -> list[str]:
    """`eval_kwargs()` as the example scripts take them. Which splits run (--do_train, --do_eval)
    stays the user's, as it always did. run_summarization.py reads generation's beams from its own
    --num_beams, which it copies over generation_num_beams whether given or not (its default is 1),
    and the length from --generation_max_length before its --val_max_target_length: that one also
    truncates and pads the eval targets, which the probe measured at --max_target_length."""
    flags = []
    for name, value in kwargs.items():
        if name == "generation_num_beams":
            flags += ["--num_beams", str(value)]
        elif value is True:
            flags.append(f"--{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags


def loss_only_caveat(config, kwargs: dict, script: str) -> list[str]:
    """What --prediction_loss_only costs an example script that computes metrics from kept logits:
    run_clm.py, run_mlm.py and run_classification.py (run_summarization.py computes them only from
    generated tokens, which a loss-only winner never has)."""
    if not kwargs.get("prediction_loss_only") or Task(config.task) == Task.SEQ2SEQ:
        return []
    return [
        (
            f"loss-only evaluation: --prediction_loss_only keeps {script}'s metrics (accuracy) from being computed, "
            f"as the probe kept no logits; search with --eval-logits kept to measure a run that computes them"
        )
    ]


def evaluation_lines(config, eval_batch: int | None, phase_peaks: dict | None) -> tuple[list[str], list[str]]:
    """`print(best)`'s lines on the run's evaluation (after the levers) and on each phase's peak
    reserved as the probe measured it (after the memory); none for a study without evaluation."""
    if not evaluation.evaluates(config):
        return [], []

    def every(steps: int) -> str:
        return "every batch" if steps == 1 else f"every {steps} batches"

    settings = [
        f"batch {eval_batch}"
        + ("" if eval_batch == config.eval_batch else f" (the largest up to {config.eval_batch} that fits)")
    ]
    if config.eval_logits == evaluation.KEPT:
        settings.append(f"logits kept (moved to the host {every(config.eval_accumulation_steps)})")
    elif not evaluation.generates(config):
        settings.append("loss only")
    if evaluation.generates(config):
        beams = config.generation_num_beams
        settings.append(
            f"generate up to {config.generation_max_length} tokens x {beams} beam{'s' if beams != 1 else ''}"
            + ("" if config.eval_logits == evaluation.KEPT else f" (tokens moved to the host {every(1)})")
        )
    return (
        [f"  eval:      {', '.join(settings)}"],
        [f"  phases:    {evaluation.describe_phases(config, phase_peaks)}"] if phase_peaks else [],
    )


def generate_with_cache(model, config) -> None:
    """A model that trains without a KV cache (use_cache=False, as probed) generates with one, as
    its probe did (probe/phases.py): generate() takes its default from the model's config, and
    without a cache runs the whole prefix again for every token (slower, and another memory)."""
    if evaluation.generates(config):
        base = getattr(model, "get_base_model", lambda: model)()  # (a PeftModel's base)
        base.generation_config.use_cache = True
