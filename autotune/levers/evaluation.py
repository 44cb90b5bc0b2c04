"""The run's phases after the training step: evaluation and generation, as recipe levers.

A fine-tune that fits its training steps can still run out of memory at its first evaluation: the
weights and the optimizer state stay resident (Trainer evaluates between optimizer steps, with the
gradients freed), and the eval batch comes on top: its forward without gradients, the logits
Trainer keeps on the card until `eval_accumulation_steps` moves them to the host, and for seq2seq
with `predict_with_generate` a `generate` call (beams, the KV cache). A probe runs these phases
after its timed training steps when the study asks for them, and a config fits only when every
phase does.

These are the user's recipe (what the run evaluates, and how), named after TrainingArguments'
fields; autotune never changes them. Torch-free: the CLI, the store and the hand-off read this.
"""

from __future__ import annotations

from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.units import INT64_MAX, format_size

# Phases of a run a probe measures, in the order it runs them.
TRAIN, EVAL, GENERATE = "train", "eval", "generate"
PHASES = (TRAIN, EVAL, GENERATE)

# What Trainer keeps of an eval batch: only its loss (no compute_metrics, or prediction_loss_only),
# or its logits too, concatenated on the card until eval_accumulation_steps moves them to the host.
LOSS_ONLY, KEPT = "loss-only", "kept"
EVAL_LOGITS = (LOSS_ONLY, KEPT)

# The recipe's fields at what a study without evaluation has: every config stored before these
# existed means exactly this (ProbeConfig's key leaves them out at these values).
EVAL_RECIPE = {
    "eval_batch": None,
    "auto_eval_batch": False,
    "eval_logits": LOSS_ONLY,
    "eval_accumulation_steps": None,
    "generation_max_length": None,
    "generation_num_beams": 1,
}
# `--eval-batch auto`: the probe finds the largest eval batch, doubling from 1, that fits beside the
# training state (evaluation takes less time per sample as the batch grows), up to this many.
# Doubling keeps the attempts few (7 up to 64); a power of two is what Trainer users pass anyway.
AUTO_EVAL_BATCH_MAX = 64
AUTO = "auto"
# Said when nothing fits a study that evaluates.
LOWER_EVAL_NEED = (
    "Evaluation runs too: a smaller --eval-batch, fewer --eval-accumulation-steps or --eval-logits "
    "loss-only (your recipe) lower its need."
)


def auto_eval_batches(config) -> list[int]:
    """The eval batches `--eval-batch auto` tries, smallest first: 1, 2, 4, ... up to its bound."""
    sizes, size = [], 1
    while size <= config.eval_batch:
        sizes.append(size)
        size *= 2
    return sizes


def recipe_fields(asked: dict | None, target_length: int | None) -> dict:
    """The EVAL_RECIPE fields of what the command line asked (`eval_batch`, `eval_logits`,
    `eval_accumulation_steps`, `generate`, `generation_max_length`, `num_beams`; any may be left
    out): kept logits move to the host every batch unless told otherwise, and generation runs to
    the task's target length unless given one (Seq2SeqTrainingArguments' generation_max_length
    falls back to the model's max_length; run_summarization.py passes its target length)."""
    asked = {k: v for k, v in (asked or {}).items() if v is not None}
    fields = dict(EVAL_RECIPE)
    fields.update({k: asked[k] for k in ("eval_batch", "eval_logits", "eval_accumulation_steps") if k in asked})
    if fields["eval_batch"] == AUTO:
        fields["eval_batch"], fields["auto_eval_batch"] = AUTO_EVAL_BATCH_MAX, True
    if fields["eval_logits"] == KEPT and fields["eval_accumulation_steps"] is None and fields["eval_batch"] is not None:
        fields["eval_accumulation_steps"] = 1
    if asked.get("generate"):
        if asked.get("generation_max_length") is None and target_length is None:
            raise BadInput("--generate is for --task seq2seq (predict_with_generate); leave it out for this task.")
        fields["generation_max_length"] = asked.get("generation_max_length") or target_length
        fields["generation_num_beams"] = asked.get("num_beams", 1)
    elif "generation_max_length" in asked or asked.get("num_beams", 1) != 1:
        raise BadInput("--generation-max-length and --num-beams are generation's: give --generate too.")
    return fields


def eval_problems(fields: dict, task: str) -> list[str]:
    """What is wrong with the evaluation fields of a config of `task` (one phrase each)."""
    problems = []
    for name, flag in (
        ("eval_batch", "--eval-batch"),
        ("eval_accumulation_steps", "--eval-accumulation-steps"),
        ("generation_max_length", "--generation-max-length"),
    ):
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT64_MAX):
            problems.append(f"{flag} must be a whole number of at least 1 (got {value!r})")
    beams = fields.get("generation_num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or not 1 <= beams <= 1024:
        problems.append(f"--num-beams must be a whole number from 1 to 1024 (got {beams!r})")
    if not isinstance(fields.get("auto_eval_batch", False), bool):
        problems.append(f"auto_eval_batch must be true or false (got {fields['auto_eval_batch']!r})")
    elif fields.get("auto_eval_batch") and fields.get("eval_batch") is None:
        problems.append("an eval batch found by the probe needs the largest to try (--eval-batch auto sets 64)")
    logits = fields.get("eval_logits", LOSS_ONLY)
    if logits not in EVAL_LOGITS:
        problems.append(f"--eval-logits {logits!r} is unknown; choose from {', '.join(EVAL_LOGITS)}")
    evaluates = fields.get("eval_batch") is not None
    if not evaluates:
        asked = [
            flag
            for name, flag in (
                ("eval_accumulation_steps", "--eval-accumulation-steps"),
                ("generation_max_length", "--generate"),
            )
            if fields.get(name) is not None
        ]
        asked += ["--eval-logits kept"] if logits == KEPT else []
        asked += ["--num-beams"] if beams != 1 else []
        if asked:
            verb = "describes" if len(asked) == 1 else "describe"
            problems.append(f"{', '.join(asked)} {verb} evaluation: give --eval-batch too")
    elif logits == LOSS_ONLY and fields.get("eval_accumulation_steps") is not None:
        problems.append("--eval-accumulation-steps moves kept logits to the host: it needs --eval-logits kept")
    elif logits == KEPT and fields.get("eval_accumulation_steps") is None:
        # Trainer's default (None) keeps every eval batch's logits on the card to the end of the eval
        # set: no probe can promise that fits, so the run is handed the number its probe kept.
        problems.append("--eval-logits kept needs --eval-accumulation-steps (eval batches kept on the card)")
    if fields.get("generation_max_length") is None and beams != 1 and evaluates:
        problems.append("--num-beams is generation's: give --generate too")
    if fields.get("generation_max_length") is not None and task != "seq2seq":
        problems.append(f"--generate is for --task seq2seq (predict_with_generate), not {task}")
    return problems


def evaluates(config) -> bool:
    """Whether a config's run evaluates (its probe runs the eval phase)."""
    return config.eval_batch is not None


def generates(config) -> bool:
    """Whether a config's evaluation generates (its probe runs the generate phase)."""
    return config.eval_batch is not None and config.generation_max_length is not None


def phases(config) -> tuple[str, ...]:
    """The phases a probe of `config` runs."""
    return (TRAIN,) + ((EVAL,) if evaluates(config) else ()) + ((GENERATE,) if generates(config) else ())


def eval_steps(config) -> int:
    """Eval batches a probe runs: as many as Trainer piles up on the card before it moves kept
    logits to the host (eval_accumulation_steps), and two for loss only (the second shows that the
    first's memory is given back)."""
    return config.eval_accumulation_steps if config.eval_logits == KEPT else 2


def label(config) -> str:
    """The evaluation part of a config's label: '' without evaluation, else e.g. ' eval8',
    ' eval8-kept4', ' eval4 gen128x4' (generation: max length x beams), ' eval-auto64' (the largest
    eval batch up to 64 that fits, found by the probe)."""
    if not evaluates(config):
        return ""
    text = f" eval-auto{config.eval_batch}" if config.auto_eval_batch else f" eval{config.eval_batch}"
    if config.eval_logits == KEPT:
        text += f"-kept{config.eval_accumulation_steps}"
    if generates(config):
        text += f" gen{config.generation_max_length}x{config.generation_num_beams}"
    return text


def describe_phases(
    config,
    phase_peaks: dict[str, dict[str, int]],
    failed_phase: str | None = None,
    eval_batch_found: int | None = None,
    absent: dict[str, str] | None = None,
) -> str:
    """Each phase's peak reserved, in the order the run has them: 'peak reserved: train 10.56 MiB,
    eval 18.43 MiB (stopped here)'; a phase without figures as `absent` says why (an estimate's
    unestimated phase), else as not reached (a probe's: its status says why)."""
    parts = []
    for phase in phases(config):
        if phase in phase_peaks:
            parts.append(
                f"{phase} {format_size(phase_peaks[phase]['reserved'])}"
                + (" (stopped here)" if phase == failed_phase else "")
            )
        else:
            parts.append(f"{phase} {(absent or {}).get(phase, 'not reached')}")
    found = (
        f" at eval batch {eval_batch_found}, the largest up to {config.eval_batch} that fits"
        if eval_batch_found
        else ""
    )
    return "peak reserved: " + ", ".join(parts) + found
