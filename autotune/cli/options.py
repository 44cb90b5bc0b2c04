"""Flags shared by several commands, and the objects they make (a config, probe settings)."""

from __future__ import annotations

import click

from autotune import defaults
from autotune.cli.app import ALLOCATOR_HELP, DB_HELP, DEVICE_HELP, LIGER_HELP, OPTIMIZER_HELP, WEIGHTS_HELP

def config_options(func):
    """The levers of one configuration, shared by `probe` and `estimate`."""
    options = [
        click.option("--model", required=True, help="Hub id, gpt2-family name, or a local directory with config.json."),
        click.option("--micro-batch", type=int, required=True, help="Sequences per forward/backward pass."),
        click.option("--block-size", type=int, required=True, help="Tokens per sequence."),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-steps per optimizer step."),
        click.option("--precision", default=defaults.PRECISION, show_default=True, help="fp32, fp16 (with a gradient scaler), bf16 (mixed precision) or tf32 (fp32 with TF32 matmuls, CUDA)."),
        click.option("--checkpointing/--no-checkpointing", default=False, show_default=True, help="Gradient (activation) checkpointing."),
        click.option("--attention", default=defaults.ATTENTION, show_default=True, help="Attention implementation: sdpa, eager, flash_attention_2, ..."),
        click.option("--optimizer", default=defaults.OPTIMIZER, show_default=True, help=OPTIMIZER_HELP),
        click.option("--weights", default="fp32", show_default=True, help=WEIGHTS_HELP),
        click.option("--compile/--no-compile", "compile_", default=False, show_default=True,
                     help="torch.compile the model (inductor); its compile time is reported apart from the timing."),
        click.option("--allocator", default="default", show_default=True, help=ALLOCATOR_HELP),
        click.option("--liger/--no-liger", default=False, show_default=True, help=LIGER_HELP),
    ]
    for option in reversed(options):
        func = option(func)
    return task_options(func)


def task_options(func):
    """What is trained (recipe levers, never searched), shared by probe, estimate, search and train."""
    from autotune.tasks import TASK_HELP

    options = [
        click.option("--task", default=None, help=f"What is trained: {TASK_HELP}."),
        click.option("--target-length", type=int, default=None,
                     help="seq2seq: target tokens per example, from your data [default: 128, as run_summarization.py]."),
        click.option("--num-labels", type=int, default=None,
                     help="classification: labels of the head [default: the config's id2label, or 2]."),
        click.option("--peft", default=None, help="lora: LoRA adapters on a frozen base (needs peft); qlora: a 4-bit base "
                                                  "too (CUDA and bitsandbytes) [default: full fine-tuning]."),
        click.option("--lora-rank", type=int, default=None, help="LoRA rank r [default: 8]."),
        click.option("--lora-alpha", type=int, default=None, help="LoRA alpha [default: 16]."),
        click.option("--lora-dropout", type=float, default=None, help="LoRA dropout [default: 0.05]."),
        click.option("--lora-targets", default=None,
                     help="Modules that get adapters: all-linear, or names such as q_proj,v_proj [default: all-linear]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_config(model, micro_batch, block_size, grad_accum, precision, checkpointing, attention, task, target_length,
                num_labels, optimizer=defaults.OPTIMIZER, weights="fp32", peft=None, compile_=False, allocator="default",
                liger=False):
    from autotune.config import ProbeConfig
    from autotune.models import resolve_model
    from autotune.space import single_config

    # The levers are checked before the model is looked for (a typo answers without a hub lookup).
    levers = dict(micro_batch=micro_batch, block_size=block_size, grad_accum=grad_accum, precision=precision.lower(),
                  checkpointing=checkpointing, attention=attention.lower(), optimizer=optimizer.strip().lower(),
                  weights=weights.strip().lower(), peft=peft, compile=compile_, allocator=allocator.strip().lower(),
                  liger=liger)
    ProbeConfig(model=model, **levers)
    return single_config(resolve_model(model), task=task, target_length=target_length, num_labels=num_labels, **levers)



def probe_settings_options(func):
    """How probes run, shared by `probe` and `search`."""
    options = [
        click.option("--device", default="auto", show_default=True, help=DEVICE_HELP),
        click.option("--safety-margin", default=defaults.SAFETY_MARGIN_TEXT, show_default=True,
                     help="Room kept free under the budget: a percentage of it or a size (256MiB). "
                          "A config fits when peak reserved + CUDA context + margin <= budget."),
        click.option("--warmup-steps", type=int, default=defaults.WARMUP_STEPS, show_default=True, help="Optimizer steps before timing (at least 2)."),
        click.option("--measure-steps", type=int, default=defaults.MEASURE_STEPS, show_default=True, help="Timed optimizer steps, at least."),
        click.option("--measure-seconds", type=float, default=defaults.MEASURE_SECONDS, show_default=True,
                     help=f"Time steps until the window is at least this long (up to {defaults.MAX_MEASURE_STEPS} steps), "
                          f"so that fast configs are timed as steadily as slow ones."),
        click.option("--probe-timeout", default=f"{defaults.PROBE_TIMEOUT_SECONDS:.0f}s", show_default=True, help="Kill a probe after this long (e.g. 90s, 10m)."),
        click.option("--trust-remote-code", is_flag=True, help="Allow a model's own code from its repository to run."),
        click.option("--max-compile-seconds", type=float, default=None,
                     help="--compile: skip a config whose compilation takes longer than this [default: no bound]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def make_settings(device, safety_margin, warmup_steps, measure_steps, measure_seconds, probe_timeout, trust_remote_code,
                  max_compile_seconds=None):
    from autotune.probe import ProbeSettings
    from autotune.units import parse_duration, parse_margin

    return ProbeSettings(device=device, margin=parse_margin(safety_margin), warmup_steps=warmup_steps,
                         measure_steps=measure_steps, measure_seconds=measure_seconds,
                         timeout=parse_duration(probe_timeout, flag="--probe-timeout"), trust_remote_code=trust_remote_code,
                         max_compile_seconds=max_compile_seconds)



def db_option(func):
    return click.option("--db", metavar="URL", default=None, help=DB_HELP)(func)


