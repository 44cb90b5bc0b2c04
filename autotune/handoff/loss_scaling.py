"""The loss under gradient accumulation, as transformers 5's Trainer scales it: right for some
models, grad_accum times too large for others, in the logged loss and the gradients alike.

Trainer hands `num_items_in_batch` (the labelled tokens of the whole optimizer step) to every model
whose forward takes `**kwargs` (every model of transformers 5), and then leaves the loss it gets back
unscaled, trusting the model to have divided by that count (`Trainer.training_step`:
`loss_is_scaled_for_ga`). Models whose loss goes through transformers' `loss_function`
(ForCausalLMLoss, ForMaskedLMLoss) do; those that compute a plain `CrossEntropyLoss` (BERT's
classifiers and masked LM, BART, Pegasus, T5: seq2seq and classification models) or whose loss
function has no such parameter (ForSequenceClassificationLoss) average each micro-batch themselves.
For those, every micro-batch's mean loss is backpropagated and logged unscaled: seen as a train loss
of 8 ln V for a random seq2seq model accumulating 8, 2 ln 2 for a two-label classifier accumulating 2,
and the gradients are as many times too large (what Adam mostly forgives, gradient clipping and
SGD do not).

The fix is a model attribute Trainer reads before anything else: `model.accepts_loss_kwargs = False`
makes it pass no count and divide every micro-batch's loss by the accumulation, as intended.
TrainingArguments has no field for it, so the hand-off carries it on the model (`load_model`) and
says it wherever only arguments travel (`print(best)`, `--format trainer-args` and `cli`).
"""

from __future__ import annotations

import inspect
from typing import Any

from autotune.levers.tasks import Task

# The attribute Trainer reads (transformers.Trainer.__init__: `unwrapped_model.accepts_loss_kwargs`).
ATTRIBUTE = "accepts_loss_kwargs"


def loss_ignores_item_count(model: Any) -> bool:
    """Whether the model computes its loss without dividing by `num_items_in_batch`: a forward that
    never names it, nor calls a transformers `loss_function` that takes it (BERT's classifiers and
    masked LM, BART, T5, ... average each micro-batch with a plain CrossEntropyLoss; Llama's
    classifier calls ForSequenceClassificationLoss, which takes no count). A LoRA model is asked of
    its base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    if "num_items_in_batch" in source:
        return False
    return "loss_function" not in source or not _loss_function_counts(base)


def _loss_function_counts(model: Any) -> bool:
    """Whether the loss function transformers picks for the model takes `num_items_in_batch`."""
    try:
        return "num_items_in_batch" in inspect.signature(model.loss_function).parameters
    except (AttributeError, TypeError, ValueError):
        return True  # cannot tell: leave Trainer's own scaling alone


def fix_loss_scaling(model: Any) -> bool:
    """Make Trainer scale `model`'s loss for accumulation itself where the model does not (sets
    `accepts_loss_kwargs = False` on the model, or on a LoRA model's base, where Trainer looks);
    True when it did."""
    if not loss_ignores_item_count(model):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    setattr(base, ATTRIBUTE, False)
    return True


def needs_loss_fix(task: str, grad_accum: int) -> bool:
    """Whether a run of `task` accumulating `grad_accum` micro-steps needs the fix, said where no model
    is at hand: transformers 5's classes of every task but causal LM compute their own loss
    (ForMaskedLMLoss takes the count, but BERT's masked LM does not use it). With one micro-step
    there is nothing to scale."""
    return grad_accum > 1 and Task(task) != Task.CAUSAL_LM


def loss_fix_note(task: str, grad_accum: int) -> str | None:
    """The one line that says the fix where only arguments travel; None where it is not needed."""
    if not needs_loss_fix(task, grad_accum):
        return None
    return (
        f"set model.{ATTRIBUTE} = False before Trainer(model=...) (best.load_model() does): transformers 5's "
        f"Trainer leaves a {task} model's loss, and its gradients, {grad_accum}x too large when it accumulates "
        f"{grad_accum} micro-batches, as this model averages each micro-batch itself"
    )
