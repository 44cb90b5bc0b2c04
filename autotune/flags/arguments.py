"""Flags' values, as the library takes them: a search space's arguments (SearchSpace.build's), probe
settings, the data's options. The command line and the service read a request through these, so a
value either would refuse is refused by both, in the same words."""

from __future__ import annotations

import click


def check_cpu_ranks(gpus: int, device: str, *, oversubscribe: bool | None = None) -> None:
    """Refuse more CPU ranks for each probe than this machine runs at once (sharding.cpu_rank_problems,
    the rule --workers follows): on --device cpu, or auto where no CUDA device can be seen."""
    from autotune.vocabulary.errors import BadInput
    from autotune.probe.runner import cuda_may_be_visible
    from autotune.levers.sharding import cpu_rank_problems

    kind = str(device).strip().lower()
    if kind == "cpu" or (kind == "auto" and not cuda_may_be_visible()):
        if problems := cpu_rank_problems(gpus, oversubscribe=oversubscribe):
            raise BadInput("; ".join(problems) + ".")


def evaluation_asked(
    eval_batch=None,
    eval_logits=None,
    eval_accumulation_steps=None,
    generate=False,
    generation_max_length=None,
    num_beams=None,
) -> dict:
    """task_options' evaluation flags, as evaluation.recipe_fields reads them."""
    return dict(
        eval_batch=_eval_batch(eval_batch),
        eval_logits=eval_logits.lower() if eval_logits else None,
        eval_accumulation_steps=eval_accumulation_steps,
        generate=generate,
        generation_max_length=generation_max_length,
        num_beams=num_beams,
    )


def recipe_arguments(
    *, peft=None, lora_rank=None, lora_alpha=None, lora_dropout=None, lora_targets=None, **evaluation
) -> dict:
    """The --peft and evaluation flags of TASK (flags/table.py) as a config, a space and a run take
    them: the adapters' stored text (recipes.peft_text) and the evaluation asked (evaluation_asked,
    whose flags `evaluation` holds)."""
    from autotune.levers.recipes import peft_text

    return dict(
        peft=peft_text(peft, lora_rank, lora_alpha, lora_dropout, lora_targets),
        evaluation=evaluation_asked(**evaluation),
    )


def _eval_batch(text: str | None) -> int | str | None:
    """--eval-batch: a whole number, or auto."""
    from autotune.levers.evaluation import AUTO

    if text is None or text.strip().lower() == AUTO:
        return None if text is None else AUTO
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither a whole number nor auto", param_hint="--eval-batch") from None


def make_settings(
    device,
    safety_margin,
    warmup_steps,
    measure_steps,
    measure_seconds,
    probe_timeout,
    trust_remote_code,
    max_compile_seconds=None,
    rendezvous=None,
):
    from autotune.probe import ProbeSettings
    from autotune.vocabulary.units import parse_duration, parse_margin

    return ProbeSettings(
        device=device,
        margin=parse_margin(safety_margin),
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        measure_seconds=measure_seconds,
        timeout=parse_duration(probe_timeout, flag="--probe-timeout"),
        trust_remote_code=trust_remote_code,
        max_compile_seconds=max_compile_seconds,
        rendezvous=rendezvous,
    )


def data_arguments(dataset, text_column, target_column, label_column, tokenizer):
    """data_options' flags as the DataOptions of search and plan (None without --dataset); a column
    flag without --dataset is a mistake."""
    from autotune.data.options import DataOptions

    if dataset is None:
        for flag, value in (
            ("--text-column", text_column),
            ("--target-column", target_column),
            ("--label-column", label_column),
            ("--tokenizer", tokenizer),
        ):
            if value is not None:
                raise click.UsageError(f"{flag} describes the data: give --dataset too, or leave {flag} out")
        return None
    return DataOptions(dataset, text_column, target_column, label_column, tokenizer=tokenizer)


def on_off_list(text: str, flag: str) -> tuple[bool, ...]:
    """'off', 'on' or 'off,on' (true/false too) as the booleans a space holds, in the order given."""
    from autotune.vocabulary.units import parse_choice_list

    values = parse_choice_list(text, flag=flag, allowed=("off", "on", "false", "true"))
    return tuple(dict.fromkeys(v in ("on", "true") for v in values))


def one_on_off(text: str | None, flag: str) -> bool | None:
    """'on' or 'off' (true/false too) as one boolean; None when not given."""
    if text is None:
        return None
    values = on_off_list(text, flag)
    if len(values) != 1:
        raise click.BadParameter("give on or off, not both: it is a recipe lever, fixed for the study", param_hint=flag)
    return values[0]


def space_arguments(
    *,
    micro_batches,
    block_sizes,
    precisions,
    checkpointing_,
    attention,
    optimizers,
    weights_,
    compile_,
    allocators,
    liger,
    trainer,
    effective_batch,
    effective_tokens,
    task,
    target_length,
    num_labels,
    packing=None,
    sampling=None,
    padding_free=None,
    gpus=1,
    strategies=None,
    nodes=1,
    dataset=None,
    text_column=None,
    target_column=None,
    label_column=None,
    tokenizer=None,
    **recipe_flags,
) -> dict:
    """space_options' flags, parsed, as SearchSpace.build's keyword arguments (`recipe_flags`: the
    --peft and evaluation flags, recipe_arguments')."""
    from autotune.levers.config import ATTENTIONS, OPTIMIZERS, PRECISIONS
    from autotune.levers.lengths import SAMPLINGS
    from autotune.levers.recipes import OPTIMIZER_ALIASES, WEIGHTS
    from autotune.levers.sharding import STRATEGIES
    from autotune.levers.speed_levers import ALLOCATORS
    from autotune.vocabulary.units import parse_choice_list, parse_int_list

    for flag, value in (("--effective-batch", effective_batch), ("--effective-tokens", effective_tokens)):
        if value is not None and value < 1:
            raise click.BadParameter(f"must be at least 1 (got {value})", param_hint=flag)
    return dict(
        micro_batches=parse_int_list(micro_batches, flag="--micro-batches") if micro_batches is not None else None,
        block_sizes=parse_int_list(block_sizes, flag="--block-sizes") if block_sizes is not None else None,
        precisions=parse_choice_list(precisions, flag="--precisions", allowed=PRECISIONS),
        checkpointing=on_off_list(checkpointing_, "--checkpointing"),
        attentions=parse_choice_list(attention, flag="--attention", allowed=ATTENTIONS),
        effective_batch=effective_batch,
        effective_tokens=effective_tokens,
        task=task,
        target_length=target_length,
        num_labels=num_labels,
        # (Trainer's names too: SearchSpace.build stores each under autotune's)
        optimizers=parse_choice_list(optimizers, flag="--optimizers", allowed=(*OPTIMIZERS, *OPTIMIZER_ALIASES)),
        weights=parse_choice_list(weights_, flag="--weights", allowed=WEIGHTS),
        trainer=trainer.strip().lower() if trainer else None,
        packing=one_on_off(packing, "--packing"),
        samplings=parse_choice_list(sampling, flag="--sampling", allowed=SAMPLINGS) if sampling is not None else None,
        padding_frees=on_off_list(padding_free, "--padding-free") if padding_free is not None else None,
        compiles=on_off_list(compile_, "--compile"),
        allocators=parse_choice_list(allocators, flag="--allocators", allowed=tuple(ALLOCATORS)),
        ligers=on_off_list(liger, "--liger"),
        **recipe_arguments(**recipe_flags),
        gpus=gpus,
        nodes=nodes,
        strategies=parse_choice_list(strategies, flag="--strategies", allowed=STRATEGIES)
        if strategies is not None
        else None,
        data=data_arguments(dataset, text_column, target_column, label_column, tokenizer),
    )
