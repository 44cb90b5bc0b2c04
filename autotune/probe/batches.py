"""The batches a probe trains on: synthetic tokens shaped as the task's run makes its batches (the
worst batch, which memory is measured on), and batches drawn from the data's lengths (what the
timed window runs: autotune.levers.lengths), padded or end to end (padding-free). The estimator traces
`synthetic_batch` on fake tensors, so everything it does is elementwise."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from autotune.levers.config import ProbeConfig
from autotune.levers.tasks import MLM_PROBABILITY, Task, padded_lengths


def synthetic_batch(config: ProbeConfig, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One micro-batch of random tokens shaped as `config.task` trains, with labels as the task's
    own training builds them. Only elementwise ops (no boolean indexing), so that the estimator's
    fake tensors trace it exactly.

    - causal-lm: labels are the input ids (the model shifts them), as run_clm.py packs blocks: no
      padding, but an attention mask of ones, which run_clm.py's group_texts keeps from the
      tokenizer, TRL's collator makes and `autotune train` packs: transformers reads it every forward
      (on SDPA, whether any token is masked: a host read; under torch.compile before torch 2.14, a
      4-D mask), which a batch without one skips.
    - seq2seq: `block_size` source tokens and `target_length` label tokens; the model makes its
      decoder inputs by shifting the labels right, as it does for DataCollatorForSeq2Seq.
    - classification: one integer label per sequence (a float for a one-output regression head).
    - masked-lm: BERT's masking of 15% of the tokens (80% become the mask token, 10% a random
      token, 10% stay); the other labels are -100, as DataCollatorForLanguageModeling makes them.
      Packed blocks, as run_mlm.py groups texts: no padding, the mask of ones it keeps.

    Padded tasks (autotune.levers.tasks.PADDED_TASKS: seq2seq, classification) carry the attention mask of
    their worst padded batch (autotune.levers.tasks.padded_lengths): a mask is not free (eager attention
    expands it to a float mask per layer and masks the softmax; on CUDA it rules the flash kernel
    out), so a probe without one measured less than the run needs.
    """
    shape = (config.micro_batch, config.block_size)
    input_ids = torch.randint(0, vocab_size, shape, device=device)
    task = Task(config.task)
    if task == Task.CAUSAL_LM:
        if config.padding_free:  # the worst batch end to end: every example of the block's length
            positions = (torch.arange(config.micro_batch * config.block_size, device=device) % config.block_size)[None]
            return flattened(config, [config.block_size] * config.micro_batch, positions, vocab_size)
        if config.lengths is not None:  # trained per example: the worst padded batch, its padding without loss
            mask = padding_mask(*shape, device)
            return {
                "input_ids": input_ids,
                "attention_mask": mask,
                "labels": torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100)),
            }
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    if task == Task.SEQ2SEQ:
        assert config.target_length is not None
        labels = torch.randint(0, vocab_size, (config.micro_batch, config.target_length), device=device)
        # Padding of the target carries no loss (DataCollatorForSeq2Seq pads labels with -100).
        target_kept = padding_mask(config.micro_batch, config.target_length, device)
        labels = torch.where(target_kept.bool(), labels, torch.full_like(labels, -100))
        return {"input_ids": input_ids, "attention_mask": padding_mask(*shape, device), "labels": labels}
    if task == Task.CLASSIFICATION:
        assert config.num_labels is not None
        mask = padding_mask(*shape, device)
        if config.num_labels == 1:
            return {
                "input_ids": input_ids,
                "attention_mask": mask,
                "labels": torch.rand(config.micro_batch, device=device),
            }
        labels = torch.randint(0, config.num_labels, (config.micro_batch,), device=device)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    # masked-lm. The mask token's id changes nothing measured: the last id of the vocabulary stands in.
    chosen = torch.rand(shape, device=device) < MLM_PROBABILITY
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    fate = torch.rand(shape, device=device)
    masked = torch.where(chosen & (fate < 0.8), torch.full_like(input_ids, vocab_size - 1), input_ids)
    randomised = torch.where(
        chosen & (fate >= 0.8) & (fate < 0.9), torch.randint_like(input_ids, 0, vocab_size), masked
    )
    return {"input_ids": randomised, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def drawn_batch(config: ProbeConfig, rows: list[int], vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch of examples of the token counts `rows` (drawn from the data's lengths:
    autotune.levers.lengths.timing_rows), padded on the right to the longest, as DataCollatorWithPadding and
    TRL's collator pad them: the padding masked out of attention and, for a causal LM, of the loss.
    Padding-free (config.padding_free): the rows end to end in one, unpadded (flattened)."""
    if config.padding_free:
        positions = torch.tensor([p for n in rows for p in range(n)], device=device)[None]
        return flattened(config, rows, positions, vocab_size)
    length = max(rows)
    mask = mask_of(rows, length, device)
    input_ids = torch.randint(0, vocab_size, (len(rows), length), device=device)
    if Task(config.task) == Task.CAUSAL_LM:
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100)),
        }
    assert config.num_labels is not None
    labels = (
        torch.rand(len(rows), device=device)
        if config.num_labels == 1
        else torch.randint(0, config.num_labels, (len(rows),), device=device)
    )
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def flattened(
    config: ProbeConfig, rows: list[int], positions: torch.Tensor, vocab_size: int
) -> dict[str, torch.Tensor]:
    """A micro-batch of examples end to end in one row (TRL's padding_free collator, transformers'
    DataCollatorWithFlattening): no attention mask (one would hide the boundaries), position ids
    restarting at each example, which is what keeps the examples apart (transformers' masking_utils
    makes a block-diagonal mask of them for SDPA and eager; flash attention's varlen kernels take each
    example alone), and no label on an example's first token (the token before it is another
    example's). TRL's collator also hands over the examples' boundaries (cu_seq_lens, seq_idx), which
    spares a flash kernel finding them from the positions in every layer. Elementwise but for those
    (made from `rows`, host numbers): the estimator traces it."""
    input_ids = torch.randint(0, vocab_size, positions.shape, device=positions.device)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": positions,
        "labels": torch.where(positions == 0, torch.full_like(input_ids, -100), input_ids),
    }
    if config.trainer == "trl":  # (TRL 1.16's DataCollatorForLanguageModeling, whatever the kernel)
        bounds = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32, device=positions.device)
        batch.update(
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=max(rows),
            max_length_k=max(rows),
            seq_idx=torch.tensor(
                [[i for i, n in enumerate(rows) for _ in range(n)]], dtype=torch.int32, device=positions.device
            ),
        )
    return batch


def padding_free_problem(model, config: ProbeConfig, vocab_size: int, device: torch.device) -> str | None:
    """Why `config`'s padding-free batches cannot train `model` as padded ones would (None: they can,
    or the config is not padding-free)."""
    if not config.padding_free or keeps_examples_apart(model, vocab_size, device):
        return None
    return (
        f"padding-free: this model's {config.attention} attention does not keep examples put end to end apart "
        f"by their position ids (each would attend to those before it: another training)"
    )


def keeps_examples_apart(model, vocab_size: int, device: torch.device) -> bool:
    """Whether `model`'s attention keeps examples put end to end in one row apart, by their position
    ids (padding-free batches need it: otherwise each example attends to those before it, and the
    run trains on something else): the second of two short examples scores the same alone as behind
    the first. transformers 5's SDPA, eager and flash kernels do; a model that builds its own mask
    without the positions, or a kernel outside transformers' mask functions, does not."""
    was_training = model.training
    model.eval()  # (no dropout: the two forwards compare)
    try:
        with torch.no_grad():
            first, second = (torch.randint(0, vocab_size, (1, 6), device=device) for _ in range(2))
            positions = torch.arange(6, device=device)[None]
            alone = model(input_ids=second, position_ids=positions).logits
            behind = model(
                input_ids=torch.cat([first, second], dim=1), position_ids=torch.cat([positions, positions], dim=1)
            ).logits[:, 6:]
        # Two forwards of other shapes round differently in 16-bit logits (bf16 weights, a 4-bit base's
        # bf16 compute): a looser bound there; an example attending to six more tokens moves them far more.
        tolerance = 1e-3 if alone.dtype == torch.float32 else 3e-2
        alone, behind = alone.float(), behind.float()
        scale = float(alone.abs().max().clamp(min=1))
        return bool(torch.allclose(alone, behind, rtol=tolerance, atol=tolerance * scale))
    finally:
        model.train(was_training)


def padding_mask(rows: int, length: int, device: torch.device) -> torch.Tensor:
    """The attention mask (1: a token, 0: padding) of the worst padded batch of `rows` examples of
    at most `length` tokens (autotune.levers.tasks.padded_lengths), elementwise for the estimator's trace."""
    return mask_of(padded_lengths(rows, length), length, device)


def mask_of(lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """The attention mask (1: a token, 0: padding on the right) of rows of `lengths` tokens padded to
    `length`, elementwise (the estimator's fake tensors trace it)."""
    rows = torch.tensor(lengths, device=device)
    return (torch.arange(length, device=device)[None, :] < rows[:, None]).long()
