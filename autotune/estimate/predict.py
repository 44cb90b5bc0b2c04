"""`estimate_memory` and `estimate_memories`: check the input, answer from the cache what it holds,
trace the rest in trace children, and add what a trace cannot see (cuBLAS workspaces, the CUDA
context)."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable

from autotune.levers import sharding
from autotune.levers import speed_levers
from autotune.levers.config import ProbeConfig
from autotune.vocabulary.defaults import ESTIMATE_TIMEOUT_SECONDS
from autotune.vocabulary.errors import BadInput
from autotune.estimate.cache import EstimateCache, cache_key
from autotune.estimate.launch import TraceChildren
from autotune.estimate.protocol import TraceItem, TraceRequest, TraceResult
import autotune.estimate.cuda_constants as cuda_constants
from autotune.estimate.result import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONSTANTS,
    CUDA_CONTEXT_BYTES,
    DEVICE_TYPES,
    MemoryEstimate,
)
from autotune.estimate.stack import Stack
from autotune.specs.models import ModelSpec, resolve_model
from autotune.levers.recipes import OPTIMIZERS, is_qlora
from autotune.vocabulary.units import format_size

_FLASH_FAMILY = ("flash_attention_2", "flash_attention_3")
# Attention kernels with no CPU implementation: traced as SDPA's CUDA kernels instead.
_TRACED_AS_SDPA = (*_FLASH_FAMILY, "flex_attention")


def check_traceable(config: ProbeConfig, device_type: str, spec: ModelSpec, trust_remote_code: bool = False) -> None:
    """BadInput for what the user must change before a trace; runs before any process starts, so
    that a wrong flag costs no trace."""
    if device_type not in DEVICE_TYPES:
        raise BadInput(
            f"--device-type {device_type!r} is unknown; choose cuda (predict a GPU run) or cpu (predict a CPU probe)."
        )
    spec.check_usable(trust_remote_code)
    spec.check_block_sizes(config.block_size, flag="--block-size")
    if config.liger:
        raise BadInput(
            "--liger: the estimator cannot trace Liger's Triton kernels; estimate without --liger for an "
            "upper bound (Liger's fused loss keeps no logits), or probe --liger on a GPU."
        )
    why = untraceable(config)
    if why:
        raise BadInput(f"{why}.")
    if device_type == "cpu" and sharding.offloads(config.strategy):
        raise BadInput(
            "--strategy fsdp-offload saves device memory by moving state to the host: a CPU probe skips it, "
            "so there is nothing to predict with --device-type cpu; estimate it for cuda, or use fsdp."
        )
    if config.attention in _TRACED_AS_SDPA:
        if device_type == "cpu":
            raise BadInput(
                f"--attention {config.attention} has no CPU kernel; use sdpa or eager with --device-type cpu."
            )
        if config.attention in _FLASH_FAMILY and config.precision in ("fp32", "tf32"):
            raise BadInput(
                f"--attention {config.attention} runs only in fp16/bf16; use --precision bf16 or fp16, or --attention sdpa."
            )


def approximations(config: ProbeConfig, device_type: str, stack: Stack | None = None) -> list[str]:
    """What an estimate of `config` approximates rather than traces, one note each."""
    notes = (stack or Stack()).notes()
    if config.compile:
        notes.append("torch.compile traced as the eager step (inductor frees intermediates no later: an upper bound)")
    if config.precision == "fp16" and device_type == "cuda":
        notes.append("fp16 traced as bf16: the same tensors, GradScaler's few scalars aside")
    if config.allocator != speed_levers.DEFAULT_ALLOCATOR:
        notes.append(
            f"allocator {config.allocator} modelled as the default allocator (expandable segments fragment "
            f"less: reserved is an upper bound)"
        )
    if config.attention in _TRACED_AS_SDPA:
        notes.append(f"{config.attention} approximated by SDPA's CUDA kernels (both keep no S x S matrix)")
    if config.ranks > 1:
        notes.append(
            f"one rank of {config.ranks} ({config.strategy}): the largest rank's memory, traced in a fake "
            f"process group; collectives' buffers inside the communication library are not seen"
        )
    if device_type == "cuda" and sharding.offloads(config.strategy):
        notes.append(
            "fsdp-offload: parameters, gradients and optimizer state are on the host and not counted; the "
            "device copies of a unit's shards made to gather it are not traced"
        )
    if device_type == "cuda":
        for what, name in (
            ("CUDA context", cuda_constants.CONTEXT),
            ("cuBLAS workspaces", cuda_constants.CUBLAS_WORKSPACES),
        ):
            figure = CUDA_CONSTANTS[name]
            notes.append(f"{what} {format_size(figure.bytes)}, {figure.source}")
    return notes


def with_unestimated(notes: list[str], unestimated: dict[str, str]) -> tuple[str, ...]:
    """An estimate's notes: what it approximates, then each phase it could not estimate, and why."""
    return (
        *notes,
        *(f"{phase} phase not estimated: {why}; the peaks are the other phases'" for phase, why in unestimated.items()),
    )


def untraceable(config: ProbeConfig) -> str | None:
    """Why the estimator cannot predict `config` on this machine (None: it can); a search probes
    such configurations unpredicted, a plan says why, `estimate` refuses with it."""
    if config.liger:
        return "liger: the estimator cannot trace Liger's Triton kernels"
    optimizer = OPTIMIZERS[config.optimizer]
    if optimizer.untraceable:
        return (
            f"--optimizer {config.optimizer}: {optimizer.untraceable}, where no trace sees it (estimate adamw_8bit: "
            f"the same 8-bit state, allocated by PyTorch)"
        )
    flag = (
        "--peft qlora"
        if is_qlora(config.peft)
        else f"--optimizer {config.optimizer}"
        if optimizer.needs == "bitsandbytes"
        else None
    )
    if flag and importlib.util.find_spec("bitsandbytes") is None:
        return f"{flag} needs bitsandbytes to be traced: pip install bitsandbytes"
    return None


def estimate_memory(
    config: ProbeConfig,
    *,
    device_type: str = "cuda",
    timeout: float = ESTIMATE_TIMEOUT_SECONDS,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    stack: Stack | None = None,
    children: TraceChildren | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of training `config`, as a probe on `device_type` would measure it.

    `device_type="cuda"` (the default) predicts a CUDA run: fused dropout masks, SDPA's flash and
    memory-efficient kernels, CUDA's autocast op lists, the caching allocator's reserved memory,
    cuBLAS workspaces and an assumed CUDA context. `"cpu"` predicts what the CPU probe accounts.
    Raises BadInput/ModelNotFound for input the user must fix (checked before any process starts)
    and EstimateError when tracing fails or takes longer than `timeout` seconds; repeats come from
    a cache under $AUTOTUNE_HOME. `trust_remote_code` lets a model's own code (auto_map) run in
    the trace child, as `--trust-remote-code` does for probes. `stack` predicts a run on older
    library versions than the installed ones (estimate/stack.py: what they did differently).
    `children` (TraceChildren) trace it, warm from earlier estimates; else a process of its own.
    """
    return estimate_memories(
        [config],
        device_type=device_type,
        timeout=timeout,
        use_cache=use_cache,
        trust_remote_code=trust_remote_code,
        stack=stack,
        children=children,
    )[0]


def estimate_memories(
    configs: list[ProbeConfig],
    *,
    device_type: str = "cuda",
    timeout: float = ESTIMATE_TIMEOUT_SECONDS,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    children: TraceChildren | None = None,
    on_estimate: Callable[[MemoryEstimate], None] | None = None,
    stack: Stack | None = None,
    memo: dict[str, MemoryEstimate] | None = None,
) -> list[MemoryEstimate]:
    """`estimate_memory` for several configurations, traced in one trace child (about 3 s of
    imports saved per configuration), or shared among `children` (started ahead, tracing in
    parallel); `timeout` applies to each. In the order given; each estimate is also given to
    `on_estimate` as soon as it is known (cached ones first). `memo`: the traces of earlier calls
    (by cache key), read and added to, so that a caller making several calls traces each config
    once even without the cache on disk (`autotune plan` over several GPU counts, DDP's shared);
    an estimate found there is marked cached, as one from the disk is: not traced now."""
    started = time.perf_counter()
    if not timeout or timeout <= 0:
        raise BadInput(f"--timeout must be a positive number of seconds (got {timeout!r}).")
    specs: dict[str, ModelSpec] = {}
    plans: list[tuple[ProbeConfig, ModelSpec, list[str], str]] = []
    for config in configs:
        if not isinstance(config, ProbeConfig):
            raise TypeError(f"config must be a ProbeConfig, not {type(config).__name__}")
        spec = specs.get(config.model) or resolve_model(config.model)
        specs[config.model] = spec
        check_traceable(config, device_type, spec, trust_remote_code)
        plans.append(
            (
                config,
                spec,
                approximations(config, device_type, stack),
                cache_key(traced_as(config, device_type), device_type, spec, stack),
            )
        )

    cache = EstimateCache() if use_cache else None
    out: list[MemoryEstimate | None] = [None] * len(plans)
    todo = []
    twins: dict[str, list[int]] = {}  # configs traced as one (traced_as): the first is traced, the rest share it
    for i, (config, _, notes, key) in enumerate(plans):
        cached = cache.get(key, time.perf_counter() - started) if cache is not None else None
        if cached is None and memo is not None and key in memo:
            cached = dataclasses.replace(memo[key], cached=True, seconds=time.perf_counter() - started)
        # The cache is keyed by the config traced (traced_as): a twin's estimate is this config's.
        out[i] = (
            None
            if cached is None
            else dataclasses.replace(cached, config=config, notes=with_unestimated(notes, cached.unestimated_phases))
        )
        if out[i] is None:
            if key not in twins:
                todo.append(i)
            twins.setdefault(key, []).append(i)

    if on_estimate is not None:
        for estimate in out:
            if estimate is not None:
                on_estimate(estimate)
    if todo:
        request = TraceRequest(
            device_type,
            tuple(
                _trace_item(traced_as(plans[i][0], device_type), plans[i][1], trust_remote_code, stack) for i in todo
            ),
        )

        def arrived(result: TraceResult) -> None:
            key = plans[todo[result.index]][3]
            for i in twins[key]:
                config, _, notes, _ = plans[i]
                estimate = _from_trace(
                    config,
                    device_type,
                    result,
                    notes,
                    seconds=time.perf_counter() - started,
                    trace_seconds=result.build_seconds + result.trace_seconds + result.replay_seconds,
                )
                out[i] = estimate
                if i == todo[result.index]:
                    if cache is not None:
                        cache.put(key, estimate)
                    if memo is not None:
                        memo[key] = estimate
                if on_estimate is not None:
                    on_estimate(estimate)

        if children is not None:
            children.answer(request, timeout, arrived)
        else:
            with TraceChildren() as own:  # (a trace child waits for more requests until closed)
                own.answer(request, timeout, arrived)
    return [e for e in out if e is not None]


def traced_as(config: ProbeConfig, device_type: str) -> ProbeConfig:
    """The config whose trace answers for `config`: speed levers that leave the eager step's memory
    an upper bound are traced without them (compile, the allocator setting), tf32 as fp32 (the
    same tensors; only the matmuls' arithmetic differs), and on CUDA fp16 as bf16: the same
    tensors of the same sizes under the same autocast lists, but for GradScaler's few scalars
    (bytes, against the caching allocator's 512-byte blocks). On CPU fp16 is traced as itself, so
    that the estimate equals what the CPU probe accounts to the byte."""
    precision = {"tf32": "fp32", **({"fp16": "bf16"} if device_type == "cuda" else {})}.get(
        config.precision, config.precision
    )
    # Micro-steps after the second repeat its allocations (trace.py traces two), and a DDP rank holds
    # the whole model, its gradients, optimizer state and buckets whatever the world size: one trace
    # answers for DDP on 2, 4 or 8 GPUs (FSDP's shards do depend on it).
    ranks = {}
    if config.ranks > 1 and not sharding.is_fsdp(config.strategy):
        ranks = {"gpus": 2, "nodes": 1}
    return dataclasses.replace(
        config,
        compile=False,
        allocator=speed_levers.DEFAULT_ALLOCATOR,
        precision=precision,
        grad_accum=min(config.grad_accum, 2),
        **ranks,
    )


def _trace_item(config: ProbeConfig, spec: ModelSpec, trust_remote_code: bool, stack: Stack | None = None) -> TraceItem:
    return TraceItem(
        config=config,
        model_config=spec.config,
        model_path=spec.path,
        trace_attention="sdpa" if config.attention in _TRACED_AS_SDPA else None,
        trust_remote_code=trust_remote_code and spec.needs_remote_code,
        stack=stack or Stack(),
    )


def _from_trace(
    config: ProbeConfig,
    device_type: str,
    result: TraceResult,
    notes: list[str],
    *,
    seconds: float,
    trace_seconds: float,
) -> MemoryEstimate:
    """The estimate from a trace, with what the trace cannot see added on CUDA."""
    cuda = device_type == "cuda"
    workspace = CUBLAS_WORKSPACE_BYTES if cuda else 0
    parts = result.breakdown
    # The cuBLAS workspaces are held from the first matmul on: in every phase.
    phase_peaks = {
        phase: {name: value + workspace for name, value in peaks.items()} for phase, peaks in result.phase_peaks.items()
    }
    return MemoryEstimate(
        config=config,
        device_type=device_type,
        params=parts["params"],
        grads=parts["grads"],
        optimizer=parts["optimizer"],
        activations=parts["activations"],
        temporaries=parts["temporaries"],
        workspace=workspace,
        peak_bytes=result.peak_bytes + workspace,
        reserved_bytes=result.reserved_bytes + workspace,  # the workspaces are segments of their own
        context_bytes=CUDA_CONTEXT_BYTES if cuda else 0,
        seconds=seconds,
        trace_seconds=trace_seconds,
        peak_phase=result.peak_phase,
        notes=with_unestimated(notes, result.unestimated),
        phase_peaks=phase_peaks,
        unestimated_phases=dict(result.unestimated),
        rank_peaks={
            rank: {name: value + workspace for name, value in peaks.items()}
            for rank, peaks in result.rank_peaks.items()
        },
    )
