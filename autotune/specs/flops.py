"""Training FLOPs per token: one count for a probe's measured MFU and the planner's predicted one,
so that the two compare. No torch here.

For N parameters (Nt of them trained), L layers, hidden size d and T tokens of context:

    forward              2N + 4*L*d*T   one multiply-add per weight; QK^T and AV, 2*d*T each per layer
    backward, inputs     2N + 8*L*d*T   the activations' gradients: the forward's matmuls again
                                        (attention's twice: the scores' and the values' sides)
    backward, weights    2Nt            weight gradients, for trained weights only: a frozen LoRA
                                        base skips them, so LoRA costs about 4N instead of 6N
    recompute            2N + 4*L*d*T   gradient checkpointing runs the forward again (6N -> 8N)

A full fine-tune without checkpointing is 6N + 12*L*d*T: 6N from Kaplan et al. 2020 ("Scaling Laws
for Neural Language Models", sec. 2.1), 12*L*d*T from PaLM (Chowdhery et al. 2022), appendix B.
Recomputation is work the card does, not useful work: MFU leaves it out (`recompute=False`).
"""

from __future__ import annotations


def flops_per_token(
    parameters: int, trained_parameters: int, layers: int, hidden: int, context: int, *, recompute: bool = False
) -> float:
    """Training FLOPs per token; `recompute` adds checkpointing's second forward."""
    attention = layers * hidden * context
    forward = 2 * parameters + 4 * attention
    total = forward + (2 * parameters + 8 * attention) + 2 * trained_parameters
    if recompute:
        total += forward
    return float(total)


def attention_flops_per_token(layers: int, hidden: int, context: int, *, recompute: bool = False) -> float:
    """The part of `flops_per_token` the attention kernel computes (QK^T and AV, forward and backward,
    and the recompute's forward): the speed model prices it at the kernel's own rate."""
    attention = layers * hidden * context
    return float((4 + 8 + (4 if recompute else 0)) * attention)
