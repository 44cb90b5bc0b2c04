"""Bytes the memory-bound passes of a training micro-step move: the speed model's memory term
(autotune/planner/card_speed.py prices them at its MEMORY_EFFICIENCY of the card's bandwidth).

  element-wise work around the matmuls: norms, activations, residual adds, dropout, rotary (about
    ELEMENTWISE_HIDDEN accesses of a hidden-wide row and ELEMENTWISE_MLP of an MLP-wide one per token
    and layer in the forward, twice that in the backward), in the activations' element size (fp32
    4, mixed precision 3 on average: fp32 norms and residual stream, half matmul outputs; pure bf16
    2); LoRA adapters' own traffic (their matmuls are rank-thin: their reads and writes cost, not
    their FLOPs); torch.compile fuses part of it (COMPILE_ELEMENTWISE_SHARE left), Liger's kernels
    part (LIGER_ELEMENTWISE_SHARE);
  autocast's casts of fp32 weights to half in each forward; QLoRA's dequantisation of its 4-bit base;
  eager attention's S x S scores (softmax in fp32, the casts and dropout on them counted by dtype);
  the logits' cross-entropy (none under Liger's fused linear cross-entropy).

Each constant is a count of reads and writes, named with what it counts. Torch-free.
"""

from __future__ import annotations

from autotune.levers.config import ProbeConfig
from autotune.estimate.stack import Stack
from autotune.levers.recipes import PeftSpec, is_qlora
from autotune.specs.shapes import ModelDims, adapted_linears
from autotune.levers.tasks import Task

# Element-wise accesses per token and layer in a forward pass, counted for a pre-norm block: two
# norms (read and write: 2 each), two residual adds (read 2, write 1: 3 each), the attention's
# reshapes and rotary or dropout (about 4): 14 hidden-wide rows; the MLP's activation reads and writes
# its input (2 MLP-wide rows; a gated MLP reads two: 3).
ELEMENTWISE_HIDDEN = 14
ELEMENTWISE_MLP = 2
ELEMENTWISE_MLP_GATED = 3
# A LoRA adapter's traffic, in rows of its module's input and output width (peft's Linear, eager). The
# adapters' matmuls are rank-thin: their FLOPs are negligible, not their reads and writes. Forward:
# dropout(x) read and written with its mask, A reading it (3 input rows); B's output written, scaled
# (read, write), added to the base's (read 2, write 1) (6 output rows). Backward: the scale's and B's
# gradients read the output's gradient (4 output rows); A's input gradient written, its weight
# gradient reading x', dropout's backward, the sum into the base's input gradient (7 input rows).
ADAPTER_FORWARD_ROWS = (3, 6)
ADAPTER_BACKWARD_ROWS = (7, 4)
# peft's adapters are fp32 whatever the base (autocast_adapter_dtype): their input side moves fp32.
ADAPTER_BYTES = 4
# Without dropout (lora_dropout 0: peft's Identity) the input is neither copied nor masked, in either pass.
ADAPTER_DROPOUT_ROWS = (2, 2)  # (forward, backward) input rows
# RMSNorm as transformers (LlamaRMSNorm, T5LayerNorm) and torchtune write it: Python ops, not one
# kernel as LayerNorm is, on a row of e-byte elements (the residual stream's: 4 under autocast over
# fp32 weights, 2 on a pure bf16 base). Forward: the upcast to fp32 (read e, write 4; none when e
# is 4), pow(2) (read 4, write 4), mean (read 4), x * rsqrt (read 4, write 4), the cast back (read
# 4, write e; none at 4), * weight (read e, write e): 20 + 2e and the casts. Backward: the weight's
# product (the input's gradient: read e, write e; the weight's: read 2e), the cast back's (read e,
# write 4), x * rsqrt's (read 4, write 4; rsqrt's gradient reads 4 + 4), pow's (2x: read 4, write
# 4; times the gradient: read 4, write 4), the two paths summed (read 8, write 4), the upcast's
# (read 4, write e): 44 + 4e and the casts. ELEMENTWISE_HIDDEN counts a norm as one read and one
# write (2e forward, 4e backward): the rest comes on top, for each of a layer's RMS_NORMS.
RMS_NORM_FORWARD, RMS_NORM_BACKWARD = 20, 44
RMS_NORMS = 2
# The backward of each element-wise op reads its saved input and the incoming gradient and writes one.
ELEMENTWISE_BACKWARD = 2.0
# Bytes per element-wise access: fp32; mixed precision (fp32 norms and residual stream, half matmul
# outputs); pure bf16.
ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "amp": 3, "half": 2}
# autocast casts each fp32 weight to half in every forward (read 4, write 2), again in a recompute.
AUTOCAST_CAST_BYTES = 6
# QLoRA dequantises its NF4 base before each use: read half a byte, write two, per weight and pass.
DEQUANT_BYTES = 2.5
# Around a 4-bit layer over an fp32 residual stream (QLoRA with the other parameters in fp32, as
# peft's prepare_model_for_kbit_training leaves them): bitsandbytes' Linear4bit casts its input to
# the compute dtype and its output back to the input's (read 4, write 2; read 2, write 4), and the
# backward casts the gradients likewise; the activations stay fp32 between the layers.
QUANTIZED_CAST_BYTES = 6
# Eager attention (transformers' eager_attention_forward, BERT's own) moves each layer's S x S
# scores per head through memory several times; in bytes per score, e the matmuls' element size:
#   forward: QK^T written (e), scaled (read, write: 2e), the mask added (2e), softmax in fp32
#     (read e, write 4), cast back to half (read 4, write e; not in fp32), dropout where the
#     model has attention dropout (read e, write e and a 1-byte mask), AV's read (e);
#   backward: AV's gradient written (e) and the probabilities read for V's (e), dropout's backward
#     (2e + 1), the cast's (e + 4), softmax's (its saved fp32 output and the gradient read, 4 + 4,
#     written in e), the scale's (2e), QK^T's two gradients reading the scores' gradient (2e).
SOFTMAX_BYTES = 4
ATTENTION_DROPOUT_BYTES = (2, 1)  # (element-sized accesses, mask bytes) of a dropout or its backward
# Head size assumed where the model's head count is not known (GPT-2, BERT: 64; Llama: 128).
HEAD_DIM_GUESS = 64
# Bytes moved per logit for the cross-entropy: fp32 upcast, log-softmax, its backward and the cast
# back, about 8 fp32-sized accesses. Liger's fused linear cross-entropy writes no logits.
LOGIT_BYTES = 32

# torch.compile (inductor) fuses chains of element-wise ops into one kernel each: about a third of
# the traffic is left (the fused kernels' inputs and outputs).
COMPILE_ELEMENTWISE_SHARE = 0.35
# Liger's fused RMSNorm, RoPE and SwiGLU read and write each row once: about 60% of the traffic left.
LIGER_ELEMENTWISE_SHARE = 0.6


def memory_bytes(config: ProbeConfig, dims: ModelDims, matmul_element: int, stack: Stack | None = None) -> float:
    """Bytes one micro-step's memory-bound passes move (module docstring), on `stack` (None: the
    installed libraries: peft's fp32 adapters); `matmul_element` the bytes of the dtype the matmuls,
    and so attention's scores, run in (speed.matmul_precision's)."""
    tokens = config.micro_batch * config.tokens_per_sequence
    return (
        elementwise_bytes(config, dims, tokens, stack)
        + cast_bytes(config, dims)
        + eager_score_bytes(config, dims, matmul_element)
        + logit_bytes(config, dims)
    )


def elementwise_bytes(config: ProbeConfig, dims: ModelDims, tokens: int, stack: Stack | None = None) -> float:
    """Bytes the element-wise ops around the matmuls move in a micro-step (module docstring)."""
    fp32_stream = is_qlora(config.peft) and config.weights != "bf16"  # Linear4bit casts its output back
    if config.weights == "bf16":
        element = ELEMENT_BYTES["half"]
    elif config.precision in ("fp16", "bf16") and not fp32_stream:
        element = ELEMENT_BYTES["amp"]
    else:
        element = ELEMENT_BYTES["fp32"]
    mlp = (dims.intermediate or 4 * dims.hidden) * (ELEMENTWISE_MLP_GATED if dims.gated else ELEMENTWISE_MLP)
    rows = (ELEMENTWISE_HIDDEN * dims.hidden + mlp) * (forwards(config) + ELEMENTWISE_BACKWARD)
    per_token = rows * element + (rms_norm_bytes_per_token(config, dims) if dims.rms_norm and not config.liger else 0)
    if config.peft is not None:
        per_token += adapter_bytes_per_token(config, dims, element, stack)
    share = (COMPILE_ELEMENTWISE_SHARE if config.compile else 1.0) * (LIGER_ELEMENTWISE_SHARE if config.liger else 1.0)
    moved = tokens * dims.layers * per_token * share
    if is_qlora(config.peft):  # the 4-bit base dequantised before each matmul that uses it
        moved += dims.parameters * DEQUANT_BYTES * (1 + forwards(config))
        if fp32_stream:
            widths = sum(fan_in + fan_out for fan_in, fan_out in dims.linear_shapes().values())
            moved += tokens * dims.layers * widths * QUANTIZED_CAST_BYTES * (forwards(config) + 1)
    return moved


def rms_norm_bytes_per_token(config: ProbeConfig, dims: ModelDims) -> float:
    """Bytes a layer's RMSNorms move per token beyond ELEMENTWISE_HIDDEN's one read and one write
    (RMS_NORM_FORWARD's count; Liger's fused RMSNorm moves only those)."""
    e = 2 if config.weights == "bf16" else 4
    casts = 2 * (4 + e) if e < 4 else 0
    forward = RMS_NORM_FORWARD + casts
    backward = RMS_NORM_BACKWARD + casts
    return RMS_NORMS * dims.hidden * (forward * forwards(config) + backward)


def forwards(config: ProbeConfig) -> int:
    """Forward passes a micro-step makes of each layer: checkpointing recomputes it in the backward."""
    return 2 if config.checkpointing else 1


def adapter_bytes_per_token(config: ProbeConfig, dims: ModelDims, element: float, stack: Stack | None = None) -> float:
    """Bytes one layer's LoRA adapters move per token (each adapter's forward again under
    checkpointing). peft keeps the adapters in fp32 (get_peft_model's autocast_adapter_dtype) and
    casts the layer's input to fp32 before dropout and A: the input side's rows are fp32, a half
    input is cast each forward (read, write 4 bytes) and its gradient cast back in the backward;
    the output side (B's output, scaled, added to the base's) is in the activations' size. On a
    stack whose adapters take the base's dtype (estimate/stack.py: fp32_adapters), a bf16 base's
    adapters move 2 bytes an element and cast nothing."""
    spec = PeftSpec.from_text(config.peft or "")
    forward_in, forward_out = ADAPTER_FORWARD_ROWS
    backward_in, backward_out = ADAPTER_BACKWARD_ROWS
    if spec.dropout == 0:
        forward_in, backward_in = forward_in - ADAPTER_DROPOUT_ROWS[0], backward_in - ADAPTER_DROPOUT_ROWS[1]
    passes = forwards(config)
    adapter = ADAPTER_BYTES if (stack or Stack()).fp32_adapters or config.weights != "bf16" else 2
    cast = element + adapter if element < adapter else 0
    per_input = (forward_in * adapter + cast) * passes + backward_in * adapter + cast
    per_output = (forward_out * passes + backward_out) * element
    return sum(per_input * fan_in + per_output * fan_out for fan_in, fan_out in adapted_linears(dims, spec.targets))


def cast_bytes(config: ProbeConfig, dims: ModelDims) -> float:
    """autocast's casts of fp32 weights to half, each forward (and recompute) of a micro-step."""
    if config.weights == "bf16" or config.precision not in ("fp16", "bf16") or is_qlora(config.peft):
        return 0.0
    return float(dims.parameters * AUTOCAST_CAST_BYTES * forwards(config))


def eager_bytes_per_score(element: int, dropout: bool) -> tuple[int, int]:
    """Bytes eager attention moves per score in a forward and in a backward (module constants)."""
    accesses, mask = ATTENTION_DROPOUT_BYTES
    drop = accesses * element + mask if dropout else 0
    cast = SOFTMAX_BYTES + element if element < SOFTMAX_BYTES else 0
    forward = element + 2 * element + 2 * element + (element + SOFTMAX_BYTES) + cast + drop + element
    backward = 2 * element + drop + cast + (2 * SOFTMAX_BYTES + element) + 2 * element + 2 * element
    return forward, backward


def eager_score_bytes(config: ProbeConfig, dims: ModelDims, element: int) -> float:
    """Bytes eager attention moves for its S x S scores in one micro-step (0 for fused kernels)."""
    if config.attention != "eager":
        return 0.0
    heads = dims.heads or max(1, dims.hidden // HEAD_DIM_GUESS)
    forward, backward = eager_bytes_per_score(element, dims.attention_dropout)
    per_score = forward * forwards(config) + backward
    return float(config.micro_batch * dims.layers * heads * config.block_size**2 * per_score)


def logit_bytes(config: ProbeConfig, dims: ModelDims) -> float:
    """Bytes the cross-entropy moves over the vocabulary's logits in one micro-step: every token
    of a causal or masked LM, the target's of seq2seq, none for classification (a small head)."""
    if config.liger or config.task == Task.CLASSIFICATION:
        return 0.0
    positions = config.target_length if config.task == Task.SEQ2SEQ else config.block_size
    return float(config.micro_batch * (positions or 0) * dims.vocab * LOGIT_BYTES)
