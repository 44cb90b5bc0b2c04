"""The estimator's trace child: trace the probe's own training steps on fake tensors and replay
the allocations. Runs in a child process (`python -m autotune.estimate.trace`; a `TraceRequest`
on stdin, one `TraceResult` line per configuration on stdout, see `protocol.py`), because it
imports torch and transformers, and so that a native crash under fake tensors ends the trace, not the
command.

What is traced is the probe's own step (`autotune.probe.step`: `build_random_model`,
`make_optimizer`, `ProbeStep`: fused AdamW, GradScaler for fp16, two prefetched batches, two
optimizer steps as the probe's warm-up), then, where the run evaluates, the probe's own later
phases (`autotune.probe.phases.LaterPhases`: evaluation, generation) with the training state
resident, so the estimate predicts what a probe measures, phase by phase, and follows it when it
changes. Under `torch._subclasses.fake_tensor.FakeTensorMode` nothing is
allocated: every tensor is a CPU "fake" with shape, dtype and storage size only.

Why a ledger of our own rather than `torch.distributed._tools.mem_tracker.MemTracker`: MemTracker
updates per-module snapshots after every op, which makes it the dominant cost (gpt2 at 8 x 512, two
steps, 2-core CPU: fake trace alone 1.1 s, with the ledger 0.9-1.0 s, with MemTracker 6.0-6.3 s; the
same peak to the byte, 12,155,842,140), counts gradients as temporaries until their hook runs, and
keeps no allocation order, which the allocator model needs. The ledger records each storage's birth
and death in order and settles its role afterwards (tests/estimate/test_trace.py checks it against
MemTracker).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib
import os
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from autotune.levers import sharding
from autotune.levers.config import ProbeConfig
import autotune.estimate.older_stacks as older_stacks
from autotune.estimate.generation import GenerationReads, UnansweredRead
from autotune.estimate.launch import PRELOAD_ENV
from autotune.estimate.ledger import Ledger, replay
from autotune.estimate.protocol import TraceFailure, TraceItem, TraceRequest, TraceResult
from autotune.levers.evaluation import EVAL, GENERATE, evaluates, generates
from autotune.probe.step import import_recipe_code
from autotune.host.processes import name_this_process
from autotune.levers.recipes import OPTIMIZERS, is_qlora

# The probe's warm-up: the second step runs with optimizer state in place, as every later one does.
OPTIMIZER_STEPS = 2
# Where the second step provably repeats the first (`repeats_its_first_step`), its events are the
# first's, copied (Ledger.repeat_events_from) instead of traced again: half a trace's time. Tests
# turn it off to check that the copy equals the traced step.
REPEAT_FIRST_STEP = True
# The optimizers whose second step makes what their first made, less their state (torch's).
REPEATING_OPTIMIZERS = {"adamw", "adamw_torch", "sgd"}


def repeats_its_first_step(config: ProbeConfig, stack) -> bool:
    """Whether a step after the first makes the first's storages again, in the same order, at the
    same sizes, less what the first made once (optimizer state, a scaler's scale): a single-GPU
    step with torch's optimizers on a stack that frees its gradients (tests/estimate/test_trace.py
    holds the copy to the traced step). Ranks (DDP rebuilds its gradient buckets in its second
    step, whose backward then makes copies the first's does not; FSDP's steps differ too),
    bitsandbytes (QLoRA's quantization state, its optimizers' paged state), transformers' Adafactor
    (its second step makes 28 storages its first does not) and gradients kept between steps are
    traced step by step."""
    return (
        config.ranks == 1
        and not is_qlora(config.peft)
        and config.optimizer in REPEATING_OPTIMIZERS
        and not stack.keeps_zeroed_grads
    )


@contextlib.contextmanager
def _real_run_mask_rules():
    """Make transformers choose the attention mask it chooses on real tensors, for one trace; put
    back after it (a trace run in a test's own process left them behind: later real forwards of
    padding-free batches in that process then lost their packing, and attended across examples).

    transformers answers from the values of the tensors it is given, which fake tensors do not have:
    - `find_packed_sequence_indices` reads the position ids, finds no packing and returns None,
      so SDPA gets `is_causal=True` and no mask. On fake tensors it cannot read them and assumes
      packing, which builds an explicit B x 1 x S x S mask (and would rule out CUDA's flash kernel).
      A padding-free batch (autotune.probe.batches.flattened) is packed: its positions are answered
      as packed, as on the real run.
    - the SDPA skip checks read a padding mask and drop it when it holds no padding. A fake mask
      counts as "tracing", which keeps it. The probe's padded batches carry padding
      (autotune.probe.batches.padding_mask): their masks, and what transformers makes of them, are
      kept, as on the real run. Every other mask is all ones (an encoder-decoder's decoder makes
      one itself: BART, Pegasus) and is dropped, as the real run drops it (bart at 2 x 64+128: 256
      KiB more than measured otherwise).
    So answer as a real run of the probe's batches does: no packing, padding only where the batch has it."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # pragma: no cover - a transformers without the module builds masks otherwise
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    from autotune.probe import batches

    saved = [(batches, name, getattr(batches, name)) for name in ("padding_mask", "flattened")]
    saved += [
        (masking, name, getattr(masking, name))
        for name in (
            "find_packed_sequence_indices",
            "_preprocess_mask_arguments",
            "_ignore_causal_mask_sdpa",
            "_ignore_bidirectional_mask_sdpa",
        )
        if hasattr(masking, name)
    ]
    padded = _TensorSet()  # the batches' masks with padding, and the masks made from them
    packed = _TensorSet()  # the position ids of padding-free batches
    make_mask, make_flattened = batches.padding_mask, batches.flattened

    def registered_padding_mask(*args, **kwargs):
        mask = make_mask(*args, **kwargs)
        padded.add(mask)
        return mask

    def registered_flattened(*args, **kwargs):
        batch = make_flattened(*args, **kwargs)
        packed.add(batch["position_ids"])
        return batch

    batches.padding_mask, batches.flattened = registered_padding_mask, registered_flattened
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if find_packed is not None:
        masking.find_packed_sequence_indices = lambda position_ids: (
            find_packed(position_ids) if position_ids in packed else None
        )
    preprocess = getattr(masking, "_preprocess_mask_arguments", None)
    if preprocess is not None:

        def preprocess_keeping_padding(config, inputs_embeds, attention_mask, *args, **kwargs):
            result = preprocess(config, inputs_embeds, attention_mask, *args, **kwargs)
            if (
                isinstance(attention_mask, torch.Tensor)
                and attention_mask in padded
                and isinstance(result[1], torch.Tensor)
            ):
                padded.add(result[1])  # the 2-D mask as a boolean: still the batch's padding
            return result

        masking._preprocess_mask_arguments = preprocess_keeping_padding
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None)
        if original is None:
            continue

        def unpadded(padding_mask, *args, _original=original, **kwargs):
            if isinstance(padding_mask, FakeTensor) and padding_mask not in padded:
                padding_mask = None  # all ones: the real run drops it
            return _original(padding_mask, *args, **kwargs)

        setattr(masking, name, unpadded)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


class _TensorSet:
    """Tensors by identity, each left out once it is freed (a WeakSet compares tensors by value)."""

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self._ids:
            self._ids.add(id(tensor))
            weakref.finalize(tensor, self._ids.discard, id(tensor))

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self._ids


@contextlib.contextmanager
def _adapters_left_in_place(adapters: bool):
    """peft moves each new adapter to its base layer's device and dtype with `Module.to`. On fake
    tensors (a tensor subclass) `Module._apply` always swaps the parameters, and cannot: fake
    tensors carry weak references. Where the trace runs the adapters are created on that device
    already, so `.to(device)` converts nothing (a fake alias of the same storage), and keeping the
    parameter is what the real run does. They are also created in fp32, where they end on the real run too (a bf16
    base's adapters are cast to bf16 and back, `autocast_adapter_dtype`, the copies gone before
    the first step), so peft's dtype move is skipped."""
    if not adapters:
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    swap, move = torch.utils.swap_tensors, BaseTunerLayer._move_adapter_to_device_of_base_layer

    def swap_unless_same(t1, t2):
        if (t1.device, t1.dtype, t1.shape) != (t2.device, t2.dtype, t2.shape):
            swap(t1, t2)

    torch.utils.swap_tensors = swap_unless_same
    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, adapter_name, device=None: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move  # type: ignore[method-assign]


@contextlib.contextmanager
def _fake_tensors_copied_as_real_ones():
    """A deep copy of a fake tensor, made as a real tensor's is (`Parameter.__deepcopy__`): its
    values cloned (a new fake storage of the same size, which the ledger counts as the real run's
    copy) and whatever else it carries copied, in the same fake mode. peft deep-copies a module it
    trains whole beside the adapters (`ModulesToSaveWrapper`: a classifier's head). torch's own
    `Tensor.__deepcopy__` reads a fake tensor's data pointer (a fake one: 0, so it clones) and then
    deep-copies the tensor's `__dict__`, and with it the `FakeTensorMode` the tensor holds: the
    mode's converter keys constant storages by `StorageWeakRef`, whose copy holds the same raw
    weak reference, so the original and the copy each release it (`torch.Storage._free_weak_ref`)
    and a storage is freed while still referenced: a trace child that aborts at a later free
    ("corrupted double-linked list") or segfaults, about one classifier QLoRA trace in four."""
    from torch._subclasses.fake_tensor import FakeTensor

    def deepcopy(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        memo[id(self)] = new
        if self.requires_grad:
            new.requires_grad_()
        for name, value in self.__dict__.items():
            if name not in new.__dict__:  # (the fake tensor's own state, its mode's included, is new's already)
                setattr(new, name, copy.deepcopy(value, memo))
        if self.grad is not None and not getattr(self, "_is_param", False):  # (as Tensor's; Parameter's leaves it)
            new.grad = copy.deepcopy(self.grad, memo)
        return new

    before = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = deepcopy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if before is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = before  # type: ignore[attr-defined]


@contextlib.contextmanager
def _bitsandbytes_maps_made_real(config):
    """bitsandbytes' 8-bit optimizers make their quantization maps (256 values) from Python
    lists, reading tensors' values, which fake tensors cannot answer. The maps are the same for
    every run: make them for real once, and give each optimizer a fake copy (allocated where the
    real run allocates it)."""
    if OPTIMIZERS[config.optimizer].needs != "bitsandbytes":
        yield
        return
    import bitsandbytes.functional as functional

    make = functional.create_dynamic_map
    made = {signed: make(signed=signed) for signed in (True, False)}  # (the optimizers' two maps)

    def copy_of_real(signed=True, *args, **kwargs):
        return make(signed, *args, **kwargs) if args or kwargs else made[signed].clone()

    functional.create_dynamic_map = copy_of_real
    try:
        yield
    finally:
        functional.create_dynamic_map = make


@dataclass(slots=True)
class _RankTrace:
    """One rank's trace (the only one on a single GPU): its replayed peaks and what it took."""

    rank: int
    replayed: dict
    unestimated: dict[str, str]
    built: float  # perf_counter when the build was done
    events: int
    kernels: dict[str, int]
    ranks_differ: bool = False  # FSDP2 shards some parameter unevenly: the last rank differs


def trace(item: TraceItem, device_type: str, index: int = 0) -> TraceResult:
    """Trace the probe's build and warm-up steps for `item.config` on fake tensors, then the run's
    later phases the probe runs after them (evaluation, generation), predicting `device_type`
    (cuda or cpu); the result is numbered `index`. On several GPUs, one rank's (the largest's:
    estimate/ranks.py)."""
    started = time.perf_counter()
    config = item.config
    cuda = device_type == "cuda"
    keep = None
    if cuda:
        from autotune.estimate.cuda import install_cuda_autocast

        keep = install_cuda_autocast()
    with _real_run_mask_rules():
        import_recipe_code(config)  # outside the ledger: those imports make tensors that live on
        if config.ranks == 1:
            traces = [_trace_rank(item, cuda, None)]
        else:
            traces = [_trace_rank(item, cuda, 0)]
            if traces[0].ranks_differ:
                traces.append(_trace_rank(item, cuda, config.ranks - 1))
    largest = max(traces, key=lambda t: (t.replayed["reserved_bytes"], t.replayed["peak_bytes"]))
    done = time.perf_counter()
    result = TraceResult(
        index=index,
        **largest.replayed,
        build_seconds=round(traces[0].built - started, 3),
        trace_seconds=round(done - traces[0].built, 3),
        replay_seconds=0.0,  # (in the trace's seconds: each rank is replayed as soon as traced)
        events=largest.events,
        kernels=largest.kernels,
        torch_version=torch.__version__,
        unestimated=largest.unestimated,
        rank_peaks={
            str(t.rank): {"allocated": t.replayed["peak_bytes"], "reserved": t.replayed["reserved_bytes"]}
            for t in traces
            if config.ranks > 1
        },
    )
    del keep
    return result


def _trace_rank(item: TraceItem, cuda: bool, rank: int | None) -> _RankTrace:
    """Trace and replay one rank (`rank` of a fake process group; None: a single-GPU run)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    import autotune.estimate.ranks as ranks
    from autotune.specs.models import ModelSpec
    from autotune.probe.step import ProbeStep, build_random_model, make_optimizer

    config = item.config
    emulation: Any = contextlib.nullcontext()  # CudaKernels when emulating CUDA
    if cuda:
        from autotune.estimate.cuda import CudaKernels

        emulation = CudaKernels()
    # Micro-steps after the second repeat the second one's allocations exactly.
    traced = dataclasses.replace(config, grad_accum=min(config.grad_accum, 2), attention=item.attention)
    device = torch.device("cpu")
    ledger = Ledger(cuda=cuda)
    # fsdp-offload keeps parameters, gradients and optimizer state on the host: not the card's.
    held = "host" if cuda and sharding.offloads(config.strategy) else None
    spec = ModelSpec(traced.model, item.model_config, "trace", item.model_path)
    differ = False
    gc.collect()
    gc.disable()  # storages die when their last reference goes, as in the real step; no stray collections
    try:
        with (
            ranks.fake_process_group(rank, config.ranks) if rank is not None else contextlib.nullcontext(),
            _adapters_left_in_place(config.peft is not None),
            _fake_tensors_copied_as_real_ones(),
            _bitsandbytes_maps_made_real(config),
            older_stacks.four_bit_inputs_kept(item.stack.keeps_4bit_inputs),
            FakeTensorMode(allow_non_fake_inputs=True),
            ledger,
            ledger.watching_resizes(),
            ranks.fake_tensor_rules(ledger) if rank is not None else contextlib.nullcontext(),
            older_stacks.softmax_inputs_kept(item.stack),
            ledger.watching_optimizer(held, held or "grads"),
            emulation,
        ):
            if rank is None:
                model, hf_config = build_random_model(spec, traced, device, item.trust_remote_code)
            else:
                from autotune.probe.distributed import build_model

                model, hf_config = build_model(spec, traced, device, item.trust_remote_code)
                ranks.all_reduce_in_place(model)
                differ = ranks.ranks_differ(model, traced)
            ledger.settle_build()
            for param in model.parameters():
                if held is not None:
                    ledger.set_role(param, held)
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(lambda p: ledger.set_role(p.grad, held or "grads"))
            optimizer = make_optimizer(model, device, traced.optimizer, "cuda" if cuda else "cpu")
            if item.stack.keeps_zeroed_grads:
                older_stacks.zeroing_grads_in_place(optimizer)
            step = ProbeStep(model, optimizer, traced, device, hf_config.vocab_size, reads_values=False)
            built = time.perf_counter()
            ledger.started = True
            repeat = REPEAT_FIRST_STEP and repeats_its_first_step(config, item.stack)
            for _ in range(OPTIMIZER_STEPS):
                if ledger.optimizer_steps >= OPTIMIZER_STEPS:
                    break  # (the last step was a copy)
                steps_before, first_event = ledger.optimizer_steps, len(ledger.events)
                try:
                    step()
                except DataDependentOutputException:
                    # ProbeStep ends by reading the loss (`.item()`), which a fake tensor cannot
                    # answer. Anything that reads a value before the step is done is a real failure.
                    # (the step ends with zero_grad: freed gradients, or zeroed ones on a stack that keeps them)
                    freed = item.stack.keeps_zeroed_grads or all(p.grad is None for p in model.parameters())
                    if ledger.optimizer_steps == steps_before or not freed:
                        raise
                # (after the except clause: the step's frame, which its exception held, is gone)
                if repeat and ledger.optimizer_steps < OPTIMIZER_STEPS:
                    repeat = ledger.repeat_events_from(first_event)
            unestimated = _later_phases(ledger, step, hf_config.vocab_size) if evaluates(config) else {}
            del step, optimizer, model
    finally:
        gc.enable()
    replayed = replay(ledger.events, cuda=cuda, stages=ledger.stages, left_out=set(unestimated))
    return _RankTrace(
        rank or 0, replayed, unestimated, built, len(ledger.events), dict(emulation.kernels) if cuda else {}, differ
    )


def _later_phases(ledger: Ledger, step, vocab_size: int) -> dict[str, str]:
    """Trace the phases the probe runs after its training steps, with the training state resident
    (`LaterPhases`, the probe's own code): evaluation, and where the run generates, generation,
    its value reads answered (estimate/generation.py). Returns the phases left unestimated, with
    why: a generate that reads a value no rule answers, or runs an op whose output fake tensors
    cannot know (a shape that depends on values); evaluation is the training forward without
    gradients, and a failure there fails the trace as the training steps' would."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from autotune.probe.phases import LaterPhases

    config = step.config
    # --eval-batch auto: the probe settles for eval batch 1 when nothing larger fits, so batch 1's
    # need is the least a fit takes (a skip on the estimate stays a lower bound, never a wrong one).
    later = LaterPhases(step, vocab_size, 1 if config.auto_eval_batch else None)
    ledger.begin(EVAL)
    later.evaluate()
    unestimated: dict[str, str] = {}
    if generates(config):
        ledger.begin(GENERATE)
        assert config.generation_max_length is not None
        ledger.reads = GenerationReads(config.generation_max_length)
        try:
            later.generate()
        except UnansweredRead as exc:
            unestimated[GENERATE] = str(exc)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            unestimated[GENERATE] = f"generate runs {exc.func}, whose output a trace on fake tensors cannot know"
        finally:
            ledger.reads = None
    return unestimated


def main() -> None:
    """Trace each requested configuration in turn, request after request; one line of answer per
    configuration."""
    # The heavy imports (torch above, transformers, its mask rules) before the request is read: a
    # search starts this process ahead of its request, so that they overlap its other start-up.
    import transformers

    with contextlib.suppress(ImportError):  # (older transformers build masks elsewhere)
        import transformers.masking_utils  # noqa: F401
    model_type = os.environ.get(PRELOAD_ENV, "").replace("-", "_")
    if model_type.isidentifier():
        # The model's code, which the first trace would import (a hint: a model type without a
        # module of that name in transformers is simply imported by its trace).
        with contextlib.suppress(ImportError):
            importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")

    import autotune.probe.step  # noqa: F401

    # Freeze the ~10^6 objects the imports made, so that each trace's gc.collect() takes
    # milliseconds rather than ~0.4 s (as the probe child does).
    gc.collect()
    gc.freeze()
    # One request per line, for as long as the parent keeps our stdin open: a search's later groups
    # and a planner's later traces find this process warm (imports and model code done).
    while line := sys.stdin.readline():
        if line.strip():
            _answer(TraceRequest.from_json(line))


def serve(stdin: Any, stdout: Any, stderr: Any) -> None:
    """main() in a trace child forked from the fork server (launch.py), with these streams (file
    descriptors the server handed over) as its standard ones."""
    for stream, fd in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(stream.fileno(), fd)
        stream.close()
    sys.stdin, sys.stdout, sys.stderr = open(0, closefd=False), open(1, "w", closefd=False), open(2, "w", closefd=False)
    name_this_process("autotune-trace")  # (its command line is the server's)
    main()


def _answer(request: TraceRequest) -> None:
    """One line per item of `request`. A failure ends the process: what it left behind (a half-built
    model, a mode still entered) must not reach the next trace."""
    for index, item in enumerate(request.items):
        try:
            result = trace(item, request.device_type, index)
        except Exception as exc:  # reported to the parent, which raises EstimateError with it
            sys.stderr.write(traceback.format_exc())
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            failure = TraceFailure(
                index=index, error_type=type(exc).__name__, message=f"{type(exc).__name__}: {first}"[:400]
            )
            sys.stdout.write(failure.to_line() + "\n")
            sys.stdout.flush()
            sys.exit(1)
        sys.stdout.write(result.to_line() + "\n")
        sys.stdout.flush()
        gc.collect()
        gc.freeze()  # what the first trace imported lazily (model code), out of every later collection


if __name__ == "__main__":
    main()
