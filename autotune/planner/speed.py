"""A cost model of training speed: seconds per optimizer step, and tokens/s, of a configuration on
a card that is not here (`autotune plan`). It is a model, not a measurement: the constants below
are first figures from published sources, to be calibrated against measured studies; a probe on
the real card has the last word.

One optimizer step is `grad_accum` micro-steps, then the optimizer:

    step = grad_accum * (compute + memory + overhead) + optimizer

compute: the micro-step's matmul FLOPs / (the card's dense peak for the precision * utilisation).
  FLOPs per token are `autotune.flops.flops_per_token`'s (the count a probe's measured MFU uses,
  so that predicted and measured MFU compare), with checkpointing's recomputation, which is work
  the card does: it is in `flops_per_step`, not in `model_flops_per_token`.
  The peak is the card's for the precision the matmuls run in: fp32 on CUDA cores, tf32 on TF32
  tensor cores, fp16/bf16 on half-precision ones; pure bf16 weights (`--weights bf16`) run bf16.
utilisation: u(t) = U_MAX * t / (t + T_HALF_TOKENS), t = micro_batch * tokens per sequence: a small
  micro-step leaves the card's multiprocessors idle and spends more of its time outside matmuls.
  torch.compile and Liger raise it, never past U_MAX.
memory: passes bound by memory bandwidth that the FLOPs do not count: eager attention's S x S score
  matrices (fused kernels never write them), and the logits' cross-entropy (Liger's fused
  linear cross-entropy never writes the logits).
overhead: kernel launches, a fixed time per kernel per layer, paid whatever the micro-step's size.
optimizer: one memory-bound pass over the trained parameters, their gradients and their state
  (on several ranks under FSDP, each rank's shard: 1/N of it).
communication, on N ranks (autotune.sharding), per optimizer step (the micro-steps before the last
  keep their gradients on the rank, as Trainer's no_sync does), ring collectives over the card's
  link (cards.py: NVLink on SXM boards, else PCIe), P the parameters' bytes as gathered, G the
  gradients' bytes as reduced:
    ddp: one all-reduce of the gradients, 2*(N-1)/N * G;
    fsdp: an all-gather of the parameters in each micro-step's forward, and again in its backward
      (resharded after forward), (N-1)/N * P each; one reduce-scatter, (N-1)/N * G;
    fsdp-grad-op: the same without the backward's all-gather;
    fsdp-offload: fsdp, plus each gather's shards copied from the host (P/N) and the gradients'
      shards back (G/N) over PCIe, and the optimizer step on the host's CPU.
  Collectives run on their own stream: they hide behind up to COMM_OVERLAP of the compute; the
  rest is exposed (`comm_seconds` is the exposed part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune import sharding
from autotune.cards import Card
from autotune.config import ProbeConfig
from autotune.flops import flops_per_token
from autotune.shapes import ModelDims, dims_from_config
from autotune.recipes import PeftSpec, is_qlora
from autotune.tasks import Task

if TYPE_CHECKING:
    from autotune.estimate import MemoryEstimate
    from autotune.models import ModelSpec

# --- Utilisation -------------------------------------------------------------------------------
# Share of the tensor cores' peak a large, well-fed micro-step reaches: single-GPU training of
# transformers reports MFU of 0.4-0.6 (PaLM 46%, Megatron-LM on A100s 52%, nanoGPT about 50% with
# torch.compile on A100).
U_MAX_TENSOR_CORES = 0.55
# Share of the plain FP32 (CUDA core) peak: fp32 matmuls are so much slower that the rest of the
# step (memory-bound element-wise work) is small beside them, so more of the step is matmuls.
U_MAX_CUDA_CORES = 0.70
# Tokens per micro-step at which utilisation is half its ceiling: below about a thousand tokens the
# matmuls are too small to fill a data-centre card. One figure for every card and model; the first
# constant to calibrate against measured studies (a bigger card needs more tokens to fill).
T_HALF_TOKENS = 1024

# --- Speed levers ------------------------------------------------------------------------------
# torch.compile (inductor) fuses element-wise work: PyTorch 2.0's launch reported 1.2x (fp32) to
# 1.5x (AMP) training speed-ups over 163 models on an A100; matmul-bound LLM fine-tunes gain less.
COMPILE_SPEEDUP = 1.15
# Share of kernel launches left after compile's fusion.
COMPILE_KERNEL_SHARE = 0.5
# Liger's fused RMSNorm, RoPE and SwiGLU kernels (its fused cross-entropy is the logits term below):
# a small gain; Liger's README reports about 20% for a whole Llama 3 8B run, logits included.
LIGER_SPEEDUP = 1.05
# QLoRA dequantises its 4-bit base in every matmul: about 39% more time than LoRA (S. Raschka,
# "Practical Tips for Finetuning LLMs Using LoRA", 2023: 33% less memory, 39% more time).
QLORA_SLOWDOWN = 1.39

# --- Memory-bound passes -----------------------------------------------------------------------
# Share of the data sheet's bandwidth a streaming kernel reaches (STREAM-like copies: 80-90%).
MEMORY_EFFICIENCY = 0.8
# Eager attention writes each layer's S x S scores per head and reads them back: element-sized
# accesses per score in the forward (QK^T written; mask, softmax and the cast each read and write;
# AV reads) and in the backward (AV's reads, the softmax's backward, dQ's and dK's reads).
EAGER_SCORE_ACCESSES_FORWARD = 8
EAGER_SCORE_ACCESSES_BACKWARD = 7
# Head size assumed where the model's head count is not known (GPT-2, BERT: 64; Llama: 128).
HEAD_DIM_GUESS = 64
# Bytes moved per logit for the cross-entropy: fp32 upcast, log-softmax, its backward and the cast
# back, about 8 fp32-sized accesses. Liger's fused linear cross-entropy writes no logits.
LOGIT_BYTES = 32

# --- Overhead ----------------------------------------------------------------------------------
# GPU time lost per kernel launched in eager PyTorch (launch latency and the gaps between dependent
# kernels; CPU dispatch of an op costs 5-20 us and hides only behind large kernels).
KERNEL_SECONDS = 10e-6
# Kernels per transformer layer in one forward pass (norms, projections, attention, activation,
# residual adds); a backward launches about twice as many, a recompute as many again.
KERNELS_PER_LAYER = 10

# --- Optimizer step ----------------------------------------------------------------------------
# Bytes one optimizer step moves per trained parameter (read + written), with fp32 weights and with
# pure bf16 weights (--weights bf16: weights, gradients and state in bf16).
OPTIMIZER_BYTES: dict[str, tuple[int, int]] = {
    "adamw": (28, 14),             # fused: reads weight, grad, m, v (16); writes weight, m, v (12)
    # torch's foreach AdamW (Trainer's adamw_torch): lerp m (3 accesses), v *= b2 and += g^2 (2 + 3),
    # decay w (2), sqrt(v) into a temporary, / bias correction, + eps (2 each), w -= lr m / t (4):
    # 20 accesses of 4 bytes.
    "adamw_torch": (80, 40),
    "adamw_8bit": (16, 10),        # weight and grad at their size, m and v one byte each
    "paged_adamw_8bit": (16, 10),  # as adamw_8bit while the state stays on the card
    "sgd": (24, 12),               # foreach, momentum: buf = m*buf + g, then w -= lr*buf (6 accesses)
    "adafactor": (60, 60),         # transformers' Adafactor: ~15 unfused fp32 passes (it upcasts bf16);
}                                  # its factored second moment is negligible
# fp16's gradient scaler unscales every fp32 gradient once (read and write; the inf check is fused).
GRAD_SCALER_BYTES = 8

# --- Communication (several ranks) -----------------------------------------------------------------
# Share of the link's bandwidth a large NCCL ring collective reaches (nccl-tests' bus bandwidth on
# 8 x H100 SXM: about 360-370 of NVLink's 450 GB/s a direction).
LINK_EFFICIENCY = 0.8
# Share of a step's compute the collectives can hide behind: DDP overlaps its buckets' all-reduce
# with the rest of the backward, FSDP prefetches the next unit's all-gather under this unit's
# compute; the first gather and the last reduction are always exposed. A first figure to calibrate.
COMM_OVERLAP = 0.5
# Bytes/s the host's CPU steps an offloaded optimizer at (torch's CPU AdamW over the shards of a
# rank: memory-bound at a few tens of GB/s on a server's socket shared by its ranks).
HOST_OPTIMIZER_BANDWIDTH = 20e9


@dataclass(frozen=True, slots=True)
class SpeedPrediction:
    """A configuration's predicted speed and its parts, per optimizer step (seconds):
    `step_seconds == compute_seconds + memory_seconds + overhead_seconds + optimizer_seconds
    + comm_seconds`."""

    step_seconds: float
    tokens_per_s: float
    compute_seconds: float       # matmuls, at `utilisation` of `peak_flops`
    memory_seconds: float        # eager attention's scores and the logits' cross-entropy
    overhead_seconds: float      # kernel launches
    optimizer_seconds: float     # the optimizer's pass over the trained parameters' state
    utilisation: float           # share of the peak the matmuls run at
    peak_flops: float            # the card's dense peak for the precision the matmuls run in
    flops_per_step: float        # what the card computes, recomputation included
    model_flops_per_token: float  # useful work per token, no recomputation (autotune.flops)
    comm_seconds: float = 0.0    # collectives (and fsdp-offload's host copies) not hidden behind compute
    gpus: int = 1                # ranks: tokens_per_s is the whole run's

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation as a probe measures it (per GPU)."""
        return self.tokens_per_s * self.model_flops_per_token / self.peak_flops / self.gpus

    def describe(self) -> str:
        parts = (("compute", self.compute_seconds), ("memory", self.memory_seconds),
                 ("launches", self.overhead_seconds), ("optimizer", self.optimizer_seconds),
                 ("communication", self.comm_seconds))
        spent = ", ".join(f"{name} {seconds / self.step_seconds:.0%}" for name, seconds in parts if seconds > 0)
        return (f"{self.tokens_per_s:,.0f} tokens/s, {self.step_seconds * 1e3:,.1f} ms/step ({spent}); "
                f"matmuls at {self.utilisation:.0%} of peak, MFU {self.mfu:.0%} (predicted)")


def matmul_precision(config: ProbeConfig) -> str:
    """The precision the matmuls run in: pure bf16 weights run bf16 whatever --precision says."""
    return "bf16" if config.weights == "bf16" else config.precision


def why_unsupported(config: ProbeConfig, card: Card) -> str | None:
    """None when `config` can run on `card`, else why not (one line)."""
    precision = matmul_precision(config)
    if precision not in card.peak_flops:
        what = "--weights bf16" if precision != config.precision else f"--precision {precision}"
        return f"{what}: the {card.name} has no {precision} (it needs compute capability 8.0, Ampere or newer)"
    if config.attention == "flash_attention_2" and not card.has_flash_attention:
        return f"flash_attention_2 needs compute capability 8.0 (Ampere) or newer, not the {card.name}"
    if config.attention == "flash_attention_3" and card.compute_capability[0] != 9:
        return f"flash_attention_3 runs on Hopper (compute capability 9.0) only, not the {card.name}"
    return None


def utilisation(tokens_per_micro_step: int, tensor_cores: bool) -> float:
    """u(t) = U_MAX * t / (t + T_HALF_TOKENS): the share of the peak a micro-step's matmuls reach."""
    ceiling = U_MAX_TENSOR_CORES if tensor_cores else U_MAX_CUDA_CORES
    return ceiling * tokens_per_micro_step / (tokens_per_micro_step + T_HALF_TOKENS)


def lora_parameters(dims: ModelDims, rank: int) -> int:
    """About how many parameters LoRA adapters of `rank` add on every linear layer: a d x d
    weight's adapter has 2*r*d, i.e. 2r/d of the weight; the embeddings get none."""
    linear = max(dims.parameters - dims.vocab * dims.hidden, 0)
    return round(linear * 2 * rank / dims.hidden)


def config_flops_per_token(config: ProbeConfig, dims: ModelDims, *, recompute: bool = True) -> float:
    """Training FLOPs per token of `config` (autotune.flops); `recompute=False` leaves out
    checkpointing's second forward (the useful work, for MFU)."""
    return flops_per_token(dims.parameters, _trained(config, dims), dims.layers, dims.hidden, config.block_size,
                           recompute=recompute and config.checkpointing)


def predict_step_seconds(config: ProbeConfig, dims: ModelDims, card: Card) -> SpeedPrediction:
    """Seconds per optimizer step of `config` on `card`, with the parts that make them up.
    ValueError when the card cannot run the config (check `why_unsupported` first)."""
    problem = why_unsupported(config, card)
    if problem is not None:
        raise ValueError(problem)
    precision = matmul_precision(config)
    peak = card.peak_flops[precision]
    half = precision in ("fp16", "bf16")
    tokens = config.micro_batch * config.tokens_per_sequence  # per micro-step

    ceiling = U_MAX_TENSOR_CORES if precision != "fp32" else U_MAX_CUDA_CORES
    u = utilisation(tokens, tensor_cores=precision != "fp32")
    u = min(ceiling, u * (COMPILE_SPEEDUP if config.compile else 1.0) * (LIGER_SPEEDUP if config.liger else 1.0))
    flops = tokens * config_flops_per_token(config, dims)
    compute = flops / (peak * u)
    if is_qlora(config.peft):
        compute *= QLORA_SLOWDOWN

    bandwidth = card.memory_bandwidth * MEMORY_EFFICIENCY
    memory = (_eager_score_bytes(config, dims, element=2 if half else 4) + _logit_bytes(config, dims)) / bandwidth

    passes = 3 + (1 if config.checkpointing else 0)  # forward, backward (twice the kernels), recompute
    kernels = dims.layers * KERNELS_PER_LAYER * passes * (COMPILE_KERNEL_SHARE if config.compile else 1.0)
    overhead = kernels * KERNEL_SECONDS

    per_parameter = OPTIMIZER_BYTES[config.optimizer][1 if config.weights == "bf16" else 0]
    per_parameter += GRAD_SCALER_BYTES if config.precision == "fp16" else 0
    sharded = sharding.is_fsdp(config.strategy)
    stepped = _trained(config, dims) / (config.ranks if sharded else 1)  # each rank steps its shard
    optimizer = stepped * per_parameter / (HOST_OPTIMIZER_BANDWIDTH if sharding.offloads(config.strategy) else bandwidth)

    accum = config.grad_accum
    comm = communication_seconds(config, dims, card)
    exposed = max(0.0, comm - COMM_OVERLAP * accum * compute)
    step = accum * (compute + memory + overhead) + optimizer + exposed
    return SpeedPrediction(
        step_seconds=step, tokens_per_s=config.tokens_per_step / step,
        compute_seconds=accum * compute, memory_seconds=accum * memory, overhead_seconds=accum * overhead,
        optimizer_seconds=optimizer, utilisation=u, peak_flops=peak, flops_per_step=accum * flops,
        model_flops_per_token=config_flops_per_token(config, dims, recompute=False),
        comm_seconds=exposed, gpus=config.ranks,
    )


def collective_bytes(config: ProbeConfig, dims: ModelDims) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective (module docstring): a ring moves
    (N-1)/N of the buffer per all-gather or reduce-scatter, twice that per all-reduce; for
    fsdp-offload also the bytes over PCIe to and from the host ("host")."""
    n = config.ranks
    if n <= 1 or config.strategy is None:
        return {}
    weight = 2 if config.weights == "bf16" else 4
    # FSDP's mixed precision gathers parameters and reduces gradients in the autocast dtype; DDP
    # reduces the fp32 master weights' gradients.
    moved = 2 if config.precision in ("fp16", "bf16") and sharding.is_fsdp(config.strategy) else weight
    params, grads = dims.parameters * moved, _trained(config, dims) * moved
    ring = (n - 1) / n
    if config.strategy == "ddp":
        return {"all-reduce": 2 * ring * _trained(config, dims) * weight}
    gathers = config.grad_accum * (2 if sharding.reshards_after_forward(config.strategy) else 1)
    out = {"all-gather": gathers * ring * params, "reduce-scatter": ring * grads}
    if sharding.offloads(config.strategy):
        out["host"] = gathers * dims.parameters * weight / n + grads / n
    return out


def communication_seconds(config: ProbeConfig, dims: ModelDims, card: Card) -> float:
    """Seconds per optimizer step the collectives (and offload's host copies) take, hidden or not."""
    moved = collective_bytes(config, dims)
    if not moved:
        return 0.0
    link = (card.interconnect_bandwidth or card.memory_bandwidth) * LINK_EFFICIENCY
    host = (card.host_bandwidth or link) * LINK_EFFICIENCY
    return sum(nbytes / (host if kind == "host" else link) for kind, nbytes in moved.items())


def predict_tokens_per_s(config: ProbeConfig, dims: ModelDims, card: Card) -> float:
    return predict_step_seconds(config, dims, card).tokens_per_s


def predict_speed(config: ProbeConfig, dims: ModelDims, card: Card,
                  estimate: MemoryEstimate | None = None) -> SpeedPrediction | None:
    """The planner's entry: None where the card cannot run `config`; with the config's memory
    estimate, the parameter count is the one the estimator traced (its weights' bytes over the
    bytes of one weight), not the count from config.json."""
    if why_unsupported(config, card) is not None:
        return None
    # (on several ranks the estimate is one rank's: its weights are a shard, or on the host)
    if estimate is not None and estimate.params > 0 and config.ranks == 1:
        if not is_qlora(config.peft):  # a 4-bit base has no whole bytes per weight to divide by
            counted = estimate.params // (2 if config.weights == "bf16" else 4)
            dims = ModelDims(counted, dims.layers, dims.hidden, dims.vocab, dims.heads, dims.trainable_parameters)
    return predict_step_seconds(config, dims, card)


def _trained(config: ProbeConfig, dims: ModelDims) -> int:
    if dims.trainable_parameters is not None:
        return dims.trainable_parameters
    if config.peft is None:
        return dims.parameters
    return lora_parameters(dims, PeftSpec.from_text(config.peft).rank)


def _eager_score_bytes(config: ProbeConfig, dims: ModelDims, element: int) -> float:
    """Bytes eager attention moves for its S x S scores in one micro-step (0 for fused kernels)."""
    if config.attention != "eager":
        return 0.0
    heads = dims.heads or max(1, dims.hidden // HEAD_DIM_GUESS)
    accesses = EAGER_SCORE_ACCESSES_FORWARD * (2 if config.checkpointing else 1) + EAGER_SCORE_ACCESSES_BACKWARD
    return float(config.micro_batch * dims.layers * heads * config.block_size ** 2 * accesses * element)


def _logit_bytes(config: ProbeConfig, dims: ModelDims) -> float:
    """Bytes the cross-entropy moves over the vocabulary's logits in one micro-step: every token
    of a causal or masked LM, the target's of seq2seq, none for classification (a small head)."""
    if config.liger or config.task == Task.CLASSIFICATION:
        return 0.0
    positions = config.target_length if config.task == Task.SEQ2SEQ else config.block_size
    return float(config.micro_batch * (positions or 0) * dims.vocab * LOGIT_BYTES)


def model_dims_of(spec: ModelSpec) -> ModelDims | None:
    """`dims_from_config` of a resolved model's config.json."""
    return dims_from_config(spec.config)
