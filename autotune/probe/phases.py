"""The run's phases after the training step, as Trainer runs them: evaluation of eval batches, and
for seq2seq with `predict_with_generate` a `generate` call on each (autotune.levers.evaluation says which
a config's run has). The probe child runs them for real after its timed training steps; the
estimator traces the same code on fake tensors.

Trainer evaluates between optimizer steps: the weights and the optimizer state are resident, the
gradients freed (`zero_grad(set_to_none=True)` ended the step), and the model is in eval mode
under no_grad. What it keeps of each eval batch is what Trainer's `evaluation_loop` keeps: the
loss, and unless only the loss is asked for, the model's outputs but the loss (the logits; a
seq2seq model's encoder states too) and the labels, concatenated on the card by transformers' own
`EvalLoopContainer` until `eval_accumulation_steps` batches moves them to the host. The probe
runs that many batches, so its peak is the card's worst moment of the evaluation.

Generation is `Seq2SeqTrainer.prediction_step`'s: `generate` with the eval batch's inputs (not its
labels), `max_length` and `num_beams` from the recipe, then the loss forward. The probe asks for
the whole length (`min_length` too): a random model would stop at an end-of-sequence token
whenever it drew one, and a trained one writes summaries up to the length it was given; the KV
cache at full length is the worst case a run meets. (The estimator relies on this: its trace
answers generate's stopping reads as a run to the whole length, estimate/generation.py.)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from autotune.levers.evaluation import KEPT, eval_steps, generates
from autotune.probe.step import ProbeStep, synthetic_batch


class LaterPhases:
    """The eval and generate phases of one probe's run, over its built model and training step."""

    def __init__(self, step: ProbeStep, vocab_size: int, eval_batch: int | None = None):
        """`eval_batch`: the eval batch to run (default: the config's; --eval-batch auto tries several)."""
        self.step = step
        self.config = step.config
        self.eval_batch = eval_batch or self.config.eval_batch
        assert self.eval_batch is not None
        self.eval_config = replace(self.config, micro_batch=self.eval_batch, grad_accum=1)
        self.vocab_size = vocab_size
        model_config = getattr(step.model, "config", None)
        # What Trainer leaves out of the kept outputs: the loss, and the model's own list (T5's past_key_values).
        self.ignore_keys = ["loss", *getattr(model_config, "keys_to_ignore_at_inference", [])]

    def _batches(self) -> list[dict[str, torch.Tensor]]:
        # Two, alternated: the eval data loader's batch in use and the one it prefetched.
        return [synthetic_batch(self.eval_config, self.vocab_size, self.step.device) for _ in range(2)]

    def evaluate(self) -> None:
        """Trainer's evaluation loop over as many eval batches as it holds on the card at most."""
        from transformers.trainer_pt_utils import EvalLoopContainer, nested_detach

        kept = self.config.eval_logits == KEPT
        losses, predictions, labels = (EvalLoopContainer(do_nested_concat=True, padding_index=-100) for _ in range(3))
        batches = self._batches()
        model = self.step.model
        model.eval()
        try:
            for index in range(eval_steps(self.config)):
                batch = batches[index % 2]
                with torch.no_grad(), self.step.autocast():
                    outputs = self.step.forward(**batch)
                loss = outputs["loss"].detach().mean()
                losses.add(loss.repeat(self.eval_batch))
                if kept:
                    logits = nested_detach(tuple(v for k, v in outputs.items() if k not in self.ignore_keys))
                    predictions.add(logits[0] if len(logits) == 1 else logits)
                    labels.add(batch["labels"])
                del outputs, loss
        finally:
            model.train()
        del losses, predictions, labels, batches

    def generate(self) -> None:
        """Seq2SeqTrainer's prediction step with generation, on one eval batch: `generate` to the
        whole length with the recipe's beams, then the loss forward; the generated tokens and the
        labels are kept, as its evaluation loop keeps them."""
        assert generates(self.config)
        config, model = self.config, self.step.model
        batch = self._batches()[0]
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        length = config.generation_max_length
        model.eval()
        try:
            tokens = model.generate(
                **inputs,
                max_length=length,
                min_length=length,
                num_beams=config.generation_num_beams,
                do_sample=False,
                use_cache=True,
            )
            with torch.no_grad(), self.step.autocast():
                loss = model(**batch)["loss"].detach().mean()
            kept = (tokens, batch["labels"], loss)
        finally:
            model.train()
        del kept, batch, inputs
