"""A cost model of training speed from the card's published peaks and the model's shapes: seconds
per optimizer step, and tokens/s, of a configuration on a card that is not here (`autotune plan`).
A model, not a measurement: a probe on the real card has the last word. Held to published GPU
throughputs by `python -m benchmarks.published --speed` (benchmarks/published/speed.toml), which
`plan` states beside its figures.

One optimizer step is `grad_accum` micro-steps, then the optimizer:

    step = grad_accum * micro + optimizer + exposed communication
    micro = max(gpu, cpu dispatch);  gpu = matmuls + memory-bound passes

matmuls: the micro-step's matmul FLOPs (autotune.specs.flops, with checkpointing's recomputation) at
  the card's dense peak in the precision they run in (fp32 on CUDA cores, tf32 and fp16/bf16 on
  tensor cores) times their efficiency: on tensor cores GEMM_EFFICIENCY of what the card's best
  matmul is measured to reach (cards.Card.matmul_ceiling: 80% of the data sheet on an H100, 87% on
  an A100, about 100% on GeForce cards), the attention kernel's FLOPs at its own rate (FlashAttention-2
  on Hopper, SDPA's kernel there, at 35%) -- plus the time to read the weights at the card's bandwidth
  (a matmul of few rows is bound by its weight reads: the roofline). QLoRA also dequantises its
  4-bit base before each use.
memory-bound passes, at MEMORY_EFFICIENCY of the bandwidth: the bytes planner/traffic.py counts
  (element-wise work around the matmuls, LoRA adapters, autocast's casts, QLoRA's dequantisation,
  eager attention's scores, the logits' cross-entropy; what compile and Liger fuse away).
cpu dispatch: eager PyTorch launches each op from Python and the autograd engine; a small micro-step's
  GPU work finishes before the next op is launched, and the step is as slow as the dispatch:
  LAYER_DISPATCH_SECONDS per layer per micro-step (forward and backward), and per LoRA-adapted
  module ADAPTER_DISPATCH_SECONDS, times CHECKPOINT_DISPATCH_FACTOR with checkpointing
  (REENTRANT_CHECKPOINT_DISPATCH_FACTOR on a stack that recomputes reentrantly) and
  AUTOCAST_DISPATCH_FACTOR under mixed precision: measured on a host (benchmarks/dispatch.py).
  torch.compile runs the graph from generated code: COMPILE_DISPATCH_SHARE of it left. The attention
  kernel does not change it: transformers 5's eager attention dispatches about as many ops per
  micro-step as SDPA (x0.94 to x1.15 over GPT-2, BERT and Llama layers, median x0.97:
  `benchmarks/dispatch.py --ops`, benchmarks/results/attention-ops-2026-12-01.json). So where the host
  is the bound (a small model's small micro-steps under autocast) an eager config is predicted as
  fast as its SDPA twin, and where the card is, slower by its scores' traffic (gpt2 on an H100, bf16,
  block 512, no accumulation: micro-batch 4, 69,413 tokens/s both; micro-batch 16, 206,703 eager
  against 277,653).

The run's stack (autotune.estimate.stack.Stack; None: autotune's own) changes two of these: the
checkpointing's recompute (reentrant before transformers 5.0) and the adapters' dtype (fp32 in peft
from 0.12.0, the base's in older peft and other LoRA code).
optimizer: a memory-bound pass over the trained parameters, their gradients and their state
  (OPTIMIZER_BYTES per parameter, at STREAM_EFFICIENCY of the bandwidth: long streaming kernels),
  plus OPTIMIZER_OPS_PER_TENSOR ops dispatched per trained tensor for optimizers that loop over
  tensors in Python (transformers' Adafactor); under FSDP each rank's shard (1/N of it).
communication, on N ranks (autotune.levers.sharding), per optimizer step (the micro-steps before the last
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
  rest is exposed (`comm_seconds` is the exposed part). The copies around them (FSDP2's copy-in and
  copy-out of the gathered parameters, the gradients into a flat buffer; DDP's buckets) are memory
  traffic on the card (collective_copy_bytes), counted with the memory-bound passes.

Every constant below is a physical count, a published figure or a measurement (the host's launch
times: benchmarks/dispatch.py), named with its source, except the two fitted to the published
table (FITTED, benchmarks/published/speed.py's `fit`, over 37 rows: the grid point that misses
the fewest of the table's goals, then the smallest median error): GEMM_EFFICIENCY and
MEMORY_EFFICIENCY, one value each for every card and model. What differs between cards beyond their
data sheets (the matmul ceiling, FlashAttention-2 on Hopper) is measured and published, not fitted:
the table's groups of one job on several cards are held out of the fit to check it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.levers import sharding
from autotune.specs.cards import Card
from autotune.levers.config import ProbeConfig
from autotune.estimate.stack import Stack
from autotune.specs.flops import attention_flops_per_token, flops_per_token
from autotune.levers.lengths import DEFAULT_SAMPLING
import autotune.planner.traffic as traffic
from autotune.specs.shapes import ModelDims, adapted_linears, dims_from_config
from autotune.levers.recipes import PeftSpec, is_qlora

if TYPE_CHECKING:
    from autotune.estimate import MemoryEstimate
    from autotune.specs.models import ModelSpec

# --- Matmuls (GEMM_EFFICIENCY: FITTED, 0.85 on a grid of 0.70-1.00) --------------------------------
# Share of what the card's best matmul reaches (its measured ceiling, cards.Card.matmul_ceiling: 80%
# of the data sheet's peak on an H100, 87% on an A100, about 100% on GeForce cards, which run above
# their boost clock) a training step's matmuls reach together, GEMMs large and small.
GEMM_EFFICIENCY = 0.85
# FlashAttention-2 on Hopper: "achieving only 35% utilization on the H100 GPU" (Shah et al. 2024,
# FlashAttention-3, arXiv:2407.08608, abstract): its Ampere-era kernel uses none of Hopper's
# asynchronous tensor-core instructions, where cuBLAS does. PyTorch's SDPA runs FA2's kernel on
# Hopper (its flash backend first; FA3's is off by default: torch 2.13's _get_fa3_sdp_enabled()).
# On Ampere and Ada FA2 reaches "50-73% of the theoretical maximum FLOPs/s on A100 ... close to
# the efficiency of GEMM operations" (Dao 2023, arXiv:2307.08691): priced as the other matmuls.
FA2_HOPPER_UTILISATION = 0.35
# fp32 matmuls on CUDA cores: cuBLAS's SGEMM runs at about 90% of the FP32 peak on large shapes
# (NVIDIA's cuBLAS performance pages); a step's mix of shapes a little less.
GEMM_EFFICIENCY_CUDA_CORES = 0.85

# --- Memory-bound passes (MEMORY_EFFICIENCY: FITTED, 0.7 on a grid of 0.3-0.9) ------------------------
# Share of the data sheet's bandwidth element-wise kernels reach (STREAM-like copies reach 80-90%;
# short, strided and reducing kernels less).
MEMORY_EFFICIENCY = 0.7

# --- Dispatch ----------------------------------------------------------------------------------
# The host's time to launch a layer's ops, measured by `python -m benchmarks.dispatch` on a 2-core
# AMD EPYC VM (benchmarks/results/dispatch-cpu-amd-epyc-2026-11-27.json; its docstring says how):
# GPT-2, BERT and Llama layers take 1.50, 1.67 and 1.69 ms forward and backward in fp32 (the
# median here), x2.17 checkpointed as autotune runs it (use_reentrant=False), x1.67 with the
# reentrant recompute older stacks ran (estimate/stack.py), x1.41 under autocast, +0.19 ms per
# LoRA-adapted module. Not fitted (autotune's own gpt2 probes on an H100, held out in
# benchmarks/results/published-speed.md, are the check).
LAYER_DISPATCH_SECONDS = 1.667e-3
CHECKPOINT_DISPATCH_FACTOR = 2.17
REENTRANT_CHECKPOINT_DISPATCH_FACTOR = 1.67
AUTOCAST_DISPATCH_FACTOR = 1.41
ADAPTER_DISPATCH_SECONDS = 0.191e-3

# --- Speed levers --------------------------------------------------------------------------------
# torch.compile runs the graph from generated code with a tenth of eager's per-op dispatch (its
# fusion of element-wise work: traffic.COMPILE_ELEMENTWISE_SHARE).
COMPILE_DISPATCH_SHARE = 0.1

# --- Optimizer step ----------------------------------------------------------------------------
# The optimizer's passes stream whole parameter-sized buffers (foreach kernels over lists of large
# tensors): they reach what a streaming copy does, not the short element-wise kernels' share.
# BabelStream's copy reaches 85-90% of an A100's or H100's data-sheet bandwidth; foreach's chunked
# launches a little less.
STREAM_EFFICIENCY = 0.8
# Bytes one optimizer step moves per trained parameter (read + written), with fp32 weights and with
# pure bf16 weights (--weights bf16: weights, gradients and state in bf16).
OPTIMIZER_BYTES: dict[str, tuple[int, int]] = {
    "adamw": (28, 14),  # fused: reads weight, grad, m, v (16); writes weight, m, v (12)
    # torch's foreach AdamW (Trainer's adamw_torch): lerp m (3 accesses), v *= b2 and += g^2 (2 + 3),
    # decay w (2), sqrt(v) into a temporary, / bias correction, + eps (2 each), w -= lr m / t (4):
    # 20 accesses of 4 bytes.
    "adamw_torch": (80, 40),
    "adamw_8bit": (16, 10),  # weight and grad at their size, m and v one byte each
    "paged_adamw_8bit": (16, 10),  # as adamw_8bit while the state stays on the card
    "sgd": (24, 12),  # foreach, momentum: buf = m*buf + g, then w -= lr*buf (6 accesses)
    "adafactor": (60, 60),  # transformers' Adafactor: ~15 unfused fp32 passes (it upcasts bf16);
}  # its factored second moment is negligible
# Ops dispatched per trained tensor: Adafactor's step is a Python loop of about 25 ops per tensor;
# bitsandbytes' 8-bit optimizers launch one kernel per tensor; fused and foreach ones a handful in all.
OPTIMIZER_OPS_PER_TENSOR = {"adafactor": 25, "adamw_8bit": 1, "paged_adamw_8bit": 1}
OP_DISPATCH_SECONDS = 8e-6
# Trained tensors per layer of a full fine-tune (GPT-2: 12 weights and biases; Llama: 9).
TENSORS_PER_LAYER = 12
# fp16's gradient scaler unscales every fp32 gradient once (read and write; the inf check is fused).
GRAD_SCALER_BYTES = 8

# --- Communication (several ranks) -----------------------------------------------------------------
# Share of the link's bandwidth a large NCCL ring collective reaches (nccl-tests' bus bandwidth on
# 8 x H100 SXM: about 360-370 of NVLink's 450 GB/s a direction).
LINK_EFFICIENCY = 0.8
# Share of a step's compute the collectives can hide behind: DDP overlaps its buckets' all-reduce
# with the rest of the backward, FSDP prefetches the next unit's all-gather under this unit's
# compute; the first gather and the last reduction are always exposed.
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
    compute_seconds: float  # matmuls, at `utilisation` of `peak_flops`
    memory_seconds: float  # eager attention's scores and the logits' cross-entropy
    overhead_seconds: float  # kernel launches
    optimizer_seconds: float  # the optimizer's pass over the trained parameters' state
    utilisation: float  # share of the peak the matmuls run at
    peak_flops: float  # the card's dense peak for the precision the matmuls run in
    flops_per_step: float  # what the card computes, recomputation included
    model_flops_per_token: float  # useful work per token, no recomputation (autotune.specs.flops)
    comm_seconds: float = 0.0  # collectives (and fsdp-offload's host copies) not hidden behind compute
    gpus: int = 1  # ranks: tokens_per_s is the whole run's

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation as a probe measures it (per GPU)."""
        return self.tokens_per_s * self.model_flops_per_token / self.peak_flops / self.gpus

    def describe(self) -> str:
        parts = (
            ("compute", self.compute_seconds),
            ("memory", self.memory_seconds),
            ("launches", self.overhead_seconds),
            ("optimizer", self.optimizer_seconds),
            ("communication", self.comm_seconds),
        )
        spent = ", ".join(f"{name} {seconds / self.step_seconds:.0%}" for name, seconds in parts if seconds > 0)
        return (
            f"{self.tokens_per_s:,.0f} tokens/s, {self.step_seconds * 1e3:,.1f} ms/step ({spent}); "
            f"matmuls at {self.utilisation:.0%} of peak, MFU {self.mfu:.0%} (predicted)"
        )


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


def lora_parameters(dims: ModelDims, rank: int, targets: str = "all-linear") -> int:
    """The parameters LoRA adapters of `rank` add on the modules `targets` names: r x (in + out)
    for each adapted linear module of each layer (shapes.adapted_linears); the embeddings get none."""
    return dims.layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in adapted_linears(dims, targets))


def config_flops_per_token(config: ProbeConfig, dims: ModelDims, *, recompute: bool = True) -> float:
    """Training FLOPs per token of `config` (autotune.specs.flops); `recompute=False` leaves out
    checkpointing's second forward (the useful work, for MFU)."""
    return flops_per_token(
        dims.parameters,
        _trained(config, dims),
        dims.layers,
        dims.hidden,
        config.block_size,
        recompute=recompute and config.checkpointing,
    )


def predict_step_seconds(
    config: ProbeConfig, dims: ModelDims, card: Card, stack: Stack | None = None
) -> SpeedPrediction:
    """Seconds per optimizer step of `config` on `card`, with the parts that make them up, run on
    `stack` (None: autotune's own, the installed libraries). ValueError when the card cannot run
    the config (check `why_unsupported` first)."""
    problem = why_unsupported(config, card)
    if problem is not None:
        raise ValueError(problem)
    if config.lengths is not None:
        # Batches of the data's lengths, each padded to its longest (autotune.levers.lengths): the step of
        # rows of the expected padded length, its throughput counting the real tokens only.
        # Padding-free: rows of the data's mean length, no padding; outside a varlen (flash) kernel
        # the attention spans the micro-batch's whole row: one row of all its tokens.
        rows = max(1, round(config.padded_tokens_per_step / config.effective_batch))
        block, micro_batch = rows, config.micro_batch
        if config.padding_free and not config.attention.startswith("flash"):
            block, micro_batch = rows * config.micro_batch, 1
        plain = dataclasses.replace(
            config,
            lengths=None,
            padding_free=False,
            sampling=DEFAULT_SAMPLING,
            block_size=block,
            micro_batch=micro_batch,
        )
        padded = predict_step_seconds(plain, dims, card, stack)
        return dataclasses.replace(padded, tokens_per_s=config.tokens_per_step / padded.step_seconds)
    precision = matmul_precision(config)
    peak = card.peak_flops[precision]
    bandwidth = card.memory_bandwidth * MEMORY_EFFICIENCY
    sharded = sharding.is_fsdp(config.strategy)

    tokens = config.micro_batch * config.tokens_per_sequence  # per micro-step
    flops = tokens * config_flops_per_token(config, dims)
    attention = tokens * attention_flops_per_token(
        dims.layers, dims.hidden, config.block_size, recompute=config.checkpointing
    )
    efficiency = matmul_efficiency(precision, card)
    # Compute (the attention kernel's at its own rate), plus the weights' reads that a GEMM of few
    # rows cannot hide behind it (the additive roofline: efficiency t / (t + ridge), the ridge being
    # the card's FLOPs per byte).
    matmul = (flops - attention) / (peak * efficiency) + attention / (peak * attention_efficiency(config, card))
    matmul += _weight_bytes(config, dims) / bandwidth
    memory = traffic.memory_bytes(config, dims, 2 if precision in ("fp16", "bf16") else 4, stack) / bandwidth
    gpu = matmul + memory
    dispatch = _dispatch_seconds(config, dims, stack)
    # dispatch hides behind a card's work until it is the longer; a CPU does both in turn
    overhead = dispatch if card.host_is_device else max(0.0, dispatch - gpu)

    per_parameter = OPTIMIZER_BYTES[config.optimizer][1 if config.weights == "bf16" else 0]
    per_parameter += GRAD_SCALER_BYTES if config.precision == "fp16" else 0
    stepped = _trained(config, dims) / (config.ranks if sharded else 1)  # each rank steps its shard
    streamed = card.memory_bandwidth * STREAM_EFFICIENCY
    optimizer = stepped * per_parameter / (HOST_OPTIMIZER_BANDWIDTH if sharding.offloads(config.strategy) else streamed)
    optimizer += (
        _trained_tensors(config, dims) * OPTIMIZER_OPS_PER_TENSOR.get(config.optimizer, 0) * OP_DISPATCH_SECONDS
    )

    accum = config.grad_accum
    comm = communication_seconds(config, dims, card)
    exposed = max(0.0, comm - COMM_OVERLAP * accum * matmul)
    copies = collective_copy_bytes(config, dims) / bandwidth  # (per optimizer step)
    step = accum * (matmul + memory + overhead) + copies + optimizer + exposed
    model_flops = config_flops_per_token(config, dims, recompute=False)
    return SpeedPrediction(
        step_seconds=step,
        tokens_per_s=config.tokens_per_step / step,
        compute_seconds=accum * matmul,
        memory_seconds=accum * memory + copies,
        overhead_seconds=accum * overhead,
        optimizer_seconds=optimizer,
        utilisation=flops / (peak * matmul),
        peak_flops=peak,
        flops_per_step=accum * flops,
        model_flops_per_token=model_flops,
        comm_seconds=exposed,
        gpus=config.ranks,
    )


def matmul_efficiency(precision: str, card: Card) -> float:
    """Share of the card's dense peak in `precision` a step's matmuls reach: fp32 on CUDA cores at
    cuBLAS's SGEMM share; on tensor cores GEMM_EFFICIENCY of the card's measured ceiling."""
    if precision == "fp32":
        return GEMM_EFFICIENCY_CUDA_CORES
    return GEMM_EFFICIENCY * card.matmul_ceiling


def attention_efficiency(config: ProbeConfig, card: Card) -> float:
    """Share of the card's dense peak the attention kernel's matmuls reach: FlashAttention-2's kernel
    (SDPA's or flash_attention_2) on Hopper at FA2_HOPPER_UTILISATION; elsewhere, eager's batched
    GEMMs included, as the other matmuls."""
    precision = matmul_precision(config)
    fused = config.attention in ("sdpa", "flash_attention_2") and precision in ("fp16", "bf16")
    if fused and card.compute_capability[0] == 9:
        return FA2_HOPPER_UTILISATION
    return matmul_efficiency(precision, card)


def _weight_bytes(config: ProbeConfig, dims: ModelDims) -> float:
    """Bytes the matmuls read of the weights in a micro-step, the roofline's floor for a small one:
    the forward, the backward's input gradients and (trained weights) weight gradients, a recompute;
    in the dtype the matmuls run in (a QLoRA base is read dequantised)."""
    element = 4 if matmul_precision(config) in ("fp32", "tf32") else 2
    passes = 1 + traffic.forwards(config)  # the forwards and the backward's input gradients
    # (under FSDP each rank's matmuls read the whole gathered weights too)
    return float(dims.parameters * element * passes + _trained(config, dims) * element)


def _dispatch_seconds(config: ProbeConfig, dims: ModelDims, stack: Stack | None = None) -> float:
    """Host time to launch a micro-step's ops (module docstring)."""
    adapters = 0
    if config.peft is not None:
        adapters = len(adapted_linears(dims, PeftSpec.from_text(config.peft).targets))
    seconds = dims.layers * (LAYER_DISPATCH_SECONDS + adapters * ADAPTER_DISPATCH_SECONDS)
    if config.checkpointing:
        reentrant = stack is not None and stack.reentrant_checkpointing
        seconds *= REENTRANT_CHECKPOINT_DISPATCH_FACTOR if reentrant else CHECKPOINT_DISPATCH_FACTOR
    seconds *= AUTOCAST_DISPATCH_FACTOR if config.precision in ("fp16", "bf16") else 1.0
    return seconds * (COMPILE_DISPATCH_SHARE if config.compile else 1.0)


def _trained_tensors(config: ProbeConfig, dims: ModelDims) -> int:
    if config.peft is not None:
        return 2 * dims.layers * len(adapted_linears(dims, PeftSpec.from_text(config.peft).targets))
    return dims.layers * TENSORS_PER_LAYER + 2


def _collective_buffers(config: ProbeConfig, dims: ModelDims) -> tuple[int, float, float, int] | None:
    """What the collectives move on N ranks, per optimizer step (None on one): the weights' element
    size, the parameters' bytes as gathered (P), the trained gradients' bytes as reduced (G), and
    the all-gathers a rank makes. FSDP's mixed precision gathers parameters and reduces gradients
    in the autocast dtype; DDP reduces the fp32 master weights' gradients."""
    if config.ranks <= 1 or config.strategy is None:
        return None
    weight = 2 if config.weights == "bf16" else 4
    moved = 2 if config.precision in ("fp16", "bf16") and sharding.is_fsdp(config.strategy) else weight
    gathers = config.grad_accum * (2 if sharding.reshards_after_forward(config.strategy) else 1)
    return weight, dims.parameters * moved, _trained(config, dims) * moved, gathers


def collective_bytes(config: ProbeConfig, dims: ModelDims) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective (module docstring): a ring moves
    (N-1)/N of the buffer per all-gather or reduce-scatter, twice that per all-reduce; for
    fsdp-offload also the bytes over PCIe to and from the host ("host")."""
    buffers = _collective_buffers(config, dims)
    if buffers is None:
        return {}
    weight, params, grads, gathers = buffers
    n = config.ranks
    ring = (n - 1) / n
    if config.strategy == "ddp":
        return {"all-reduce": 2 * ring * grads}
    out = {"all-gather": gathers * ring * params, "reduce-scatter": ring * grads}
    if sharding.offloads(config.strategy):
        out["host"] = gathers * dims.parameters * weight / n + grads / n
    return out


def collective_copy_bytes(config: ProbeConfig, dims: ModelDims) -> float:
    """Bytes the card's memory moves per optimizer step around the collectives (module docstring):
    FSDP2 copies its shard into the all-gather's flat buffer (P/N read and written) and the gathered
    parameters out to each unsharded parameter (P read and written), at every gather; its
    reduce-scatter first copies the gradients into a flat buffer (G read and written). DDP copies
    the gradients into its buckets and back (gradient_as_bucket_view off, its default). Memory-bound
    kernels on the card beside the compute: not hidden behind it."""
    buffers = _collective_buffers(config, dims)
    if buffers is None:
        return 0.0
    _, params, grads, gathers = buffers
    if config.strategy == "ddp":
        return 4.0 * grads
    return gathers * (2 * params + 2 * params / config.ranks) + 2 * grads


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


def predict_speed(
    config: ProbeConfig, dims: ModelDims, card: Card, estimate: MemoryEstimate | None = None, stack: Stack | None = None
) -> SpeedPrediction | None:
    """The planner's entry: None where the card cannot run `config`; with the config's memory
    estimate, the parameter count is the one the estimator traced (its weights' bytes over the
    bytes of one weight), not the count from config.json. `stack`: the run's, where not autotune's."""
    if why_unsupported(config, card) is not None:
        return None
    # (on several ranks the estimate is one rank's: its weights are a shard, or on the host)
    if estimate is not None and estimate.params > 0 and config.ranks == 1:
        if not is_qlora(config.peft):  # a 4-bit base has no whole bytes per weight to divide by
            counted = estimate.params // (2 if config.weights == "bf16" else 4)
            dims = dataclasses.replace(dims, parameters=counted)
    return predict_step_seconds(config, dims, card, stack)


def _trained(config: ProbeConfig, dims: ModelDims) -> int:
    if dims.trainable_parameters is not None:
        return dims.trainable_parameters
    if config.peft is None:
        return dims.parameters
    spec = PeftSpec.from_text(config.peft)
    return lora_parameters(dims, spec.rank, spec.targets)


def model_dims_of(spec: ModelSpec) -> ModelDims | None:
    """`dims_from_config` of a resolved model's config.json."""
    return dims_from_config(spec.config)
