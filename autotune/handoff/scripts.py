"""The hand-off to the Hugging Face example scripts (transformers/examples/pytorch): the flags that say
the winner to run_clm.py and its siblings, and what no flag of theirs can say."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import autotune.handoff.later_phases as later_phases
import autotune.handoff.ranks as ranks
from autotune.handoff.loss_scaling import loss_fix_note
from autotune.levers.recipes import OPTIMIZERS, PeftSpec, is_qlora
from autotune.levers.tasks import EXAMPLE_SCRIPTS, Task

if TYPE_CHECKING:
    from autotune.handoff.best_config import BestConfig

__all__ = ["cli_caveats", "cli_flags"]

# Words that an unquoted `$(...)` in bash or zsh passes on unchanged: no space to split at, no
# glob character, no quote or `$` the shell would keep literally where the user expected it read.
_SPLITS_AS_ONE_WORD = re.compile(r'[A-Za-z0-9_.,:=/+{}"-]+')


def cli_flags(best: BestConfig) -> str:
    """The matching flags of the task's Hugging Face example script (transformers/examples/pytorch):
    run_clm.py, run_summarization.py, run_classification.py (run_glue.py takes the same
    length flag) or run_mlm.py. The lengths are the ones the probes measured; the seq2seq and
    classification scripts pad to them with --pad_to_max_length, as the probes' batches are full."""
    c = best.config
    task = Task(c.task)
    flags = ["--per_device_train_batch_size", str(c.micro_batch), "--gradient_accumulation_steps", str(c.grad_accum)]
    if task == Task.SEQ2SEQ:
        flags += [
            "--max_source_length",
            str(c.block_size),
            "--max_target_length",
            str(c.target_length),
            "--pad_to_max_length",
        ]
    elif task == Task.CLASSIFICATION:
        # (timed on the data's lengths: each batch padded to its longest, DataCollatorWithPadding's way)
        flags += [
            "--max_seq_length",
            str(c.block_size),
            *(["--pad_to_max_length"] if c.lengths is None else ["--pad_to_max_length", "False"]),
        ]
    elif task == Task.MASKED_LM:
        flags += ["--max_seq_length", str(c.block_size)]
    else:
        flags += ["--block_size", str(c.block_size)]
    flags += later_phases.eval_flags(best.eval_kwargs())
    flags += ["--optim", OPTIMIZERS[c.optimizer].optim]
    if OPTIMIZERS[c.optimizer].optim_args:
        flags += ["--optim_args", str(OPTIMIZERS[c.optimizer].optim_args)]
    if c.precision in ("fp16", "bf16"):
        flags.append(f"--{c.precision}")
    elif c.precision == "tf32":
        flags += ["--tf32", "true"]  # TrainingArguments' tf32 takes a value (a bare --tf32 is refused)
    if c.weights == "bf16" and task == Task.CAUSAL_LM:
        # Pure bf16: run_clm.py loads the model in the dtype it is given (--torch_dtype before
        # transformers 4.56, rejected by the scripts of transformers 5); the others have no flag.
        flags += ["--dtype", "bfloat16"]
    if c.checkpointing:
        # Compact JSON: one word with no space, so that `$(autotune best --format cli)` splits
        # it as the script expects (quotes inside a substitution are not the shell's).
        flags += [
            "--gradient_checkpointing",
            "--gradient_checkpointing_kwargs",
            json.dumps({"use_reentrant": False}, separators=(",", ":")),
        ]
    if c.compile:
        flags.append("--torch_compile")
        if c.precision != "tf32":
            # Said explicitly, as in trainer_args(): left unset, transformers turns TF32 on for a
            # compiled run, through the API torch.compile 2.10/2.11 refuses beside the legacy one.
            flags += ["--tf32", "false"]
    if c.liger:
        flags.append("--use_liger_kernel")
    kwargs = best.trainer_kwargs()  # (the sampler's key as the installed transformers names it)
    if "train_sampling_strategy" in kwargs:
        flags += ["--train_sampling_strategy", kwargs["train_sampling_strategy"]]
    elif kwargs.get("group_by_length"):
        flags.append("--group_by_length")
    if best.device_type == "cpu":
        flags.append("--use_cpu")  # the study measured a CPU run
    assert all(_SPLITS_AS_ONE_WORD.fullmatch(flag) for flag in flags), flags
    return " ".join(flags)


def cli_caveats(best: BestConfig) -> list[str]:
    """What the example script's flags cannot say about the winner (for stderr, beside `cli`)."""
    c = best.config
    script = EXAMPLE_SCRIPTS[Task(c.task)]
    caveats = []
    if c.attention != "sdpa":
        caveats.append(
            f"attention {c.attention}: {script} has no flag for it (it loads sdpa); load the model with "
            f"attn_implementation={c.attention!r}, or train with `autotune train --study {best.row.study}`"
        )
    if c.weights == "bf16" and Task(c.task) != Task.CAUSAL_LM:  # run_clm.py takes --dtype (cli_flags)
        caveats.append(
            f"pure bf16 weights: {script} has no flag to load the model in bf16; load it with "
            f"dtype=torch.bfloat16, or train with `autotune train --study {best.row.study}`"
        )
    if c.peft is not None:
        caveats.append(
            f"{PeftSpec.from_text(c.peft).text()}: {script} has no PEFT flags; wrap the model with "
            f"`autotune.best(...).lora_config()`, or train with `autotune train --study {best.row.study}`"
        )
    if is_qlora(c.peft):
        caveats.append(
            f"4-bit base: {script} cannot quantize; load the model with quantization_config="
            f"`autotune.best(...).quantization_config()`, or train with `autotune train --study {best.row.study}`"
        )
    if Task(c.task) == Task.CAUSAL_LM and c.lengths is not None:
        rows = "end to end without padding" if c.padding_free else "each padded to its batch's longest"
        caveats.append(
            f"one example per row, {rows}, as the probes timed: {script} packs examples into blocks "
            f"instead; train with `autotune train --study {best.row.study}`, TRL (--format trl), or "
            f"Trainer(data_collator=best.data_collator(tokenizer))"
        )
    caveats += later_phases.loss_only_caveat(c, best.eval_kwargs(), script)
    if (note := loss_fix_note(c.task, c.grad_accum)) is not None:
        caveats.append(
            f"loss under accumulation: {script} has no flag for it; {note}, or train with "
            f"`autotune train --study {best.row.study}`"
        )
    if c.ranks > 1:  # the flags are per process; the processes and their sharing are the launcher's
        caveats.append(
            f"{c.ranks} GPUs, {c.strategy}: start {script} with `{best.launch_command(script)}` (the file: "
            f"`autotune best --study {best.row.study} --format accelerate > {ranks.ACCELERATE_CONFIG_FILE}`); "
            f"effective batch = {c.micro_batch} x {c.grad_accum} x {c.ranks} = {c.effective_batch}"
        )
    if environment := best.allocator_environment():  # read once, when CUDA starts: no flag can set it
        settings = " ".join(f"{name}={value}" for name, value in environment.items())
        caveats.append(
            f"allocator {c.allocator}: start {script} with {settings} in its environment "
            f"(`{settings} python {script} ...`)"
        )
    if (openmp := best.openmp_caveat(script)) is not None:
        caveats.append(openmp)
    return caveats
