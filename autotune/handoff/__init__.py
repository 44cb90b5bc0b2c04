"""The hand-off: a study's winning configuration in the forms a fine-tune consumes.

    import autotune
    best = autotune.best("gpt2-8GiB")
    print(best)                                            # what won, what it needs, how to hand it off
    args = best.training_arguments(output_dir="out")       # a real transformers.TrainingArguments
    model = best.load_model("gpt2")                        # the task's Auto class: from_pretrained (hub id or
                                                           # directory) or from_config (a PretrainedConfig)
    model = peft.get_peft_model(model, best.lora_config())  # LoRA and QLoRA winners (load_model adds no adapters)

By hand: `from_pretrained(name, **best.model_kwargs())` (load arguments and config fields together, as
from_pretrained takes them), or `from_config(config, **best.load_kwargs())` after
`config.update(best.config_overrides())` (transformers 5's from_config passes no config field through).
The Auto class and example script of the study's task: `best.task_document()`.

A study that measured the run's evaluation hands it off too (handoff/later_phases.py); one that
generates, as a `Seq2SeqTrainingArguments` for a `Seq2SeqTrainer`.
"""

from autotune.handoff.argument_names import checkpointing_argument_names
from autotune.handoff.best_config import BestConfig, best

__all__ = ["BestConfig", "best", "checkpointing_argument_names"]
