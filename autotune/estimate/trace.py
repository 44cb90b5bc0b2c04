"""The estimator's trace child: trace the probe's own training steps on fake tensors and replay
the allocations. Runs in a child process (`python -m autotune.estimate.trace`; a `TraceRequest`
on stdin, one `TraceResult` line per configuration on stdout, see `protocol.py`), because it
imports torch and transformers and because some fake-tensor paths abort the process.

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autotune.estimate import older_stacks
from autotune.estimate.allocator import CachingAllocatorModel
from autotune.estimate.generation import GenerationReads, UnansweredRead
from autotune.estimate.launch import PRELOAD_ENV
from autotune.estimate.protocol import TraceFailure, TraceItem, TraceRequest, TraceResult
from autotune.evaluation import EVAL, GENERATE, TRAIN, evaluates, generates
from autotune.recipes import OPTIMIZERS
from autotune.units import round_to_block

ROLES = ("params", "grads", "optimizer", "activations", "temporaries")
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_REDUCED = (torch.bfloat16, torch.float16)
# The probe's warm-up: the second step runs with optimizer state in place, as every later one does.
OPTIMIZER_STEPS = 2


@dataclass(eq=False, slots=True)
class _Storage:
    nbytes: int
    phase: str
    role: str | None = None  # settled when known: params, grads, optimizer, host (not on the GPU)
    block: object = None     # the allocator model's block while replaying
    corrected: bool = False  # its size is the real kernel's, not the fake storage's (see Ledger)


def _fp32_weight(args: tuple) -> bool:
    weight = args[2] if len(args) > 2 else None
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


class Ledger(TorchDispatchMode):
    """Records, in order, every storage an op creates and the moment it is freed, with the phase
    of the step it happened in: build, forward, backward, recompute (checkpointing) or optimizer;
    after the training steps, the run's later phases (autotune.evaluation: eval, generate), each
    begun with `begin`, so that the replay can tell each one's peaks."""

    def __init__(self, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda             # predicting CUDA kernels (else CPU ones)
        self.started = False         # False while the model is being built
        self.in_optimizer = False
        self.optimizer_steps = 0
        self.events: list[tuple[int, _Storage, str]] = []  # (+1 born / -1 freed, storage, phase)
        self.stage = TRAIN           # the run's phase (autotune.evaluation) in progress
        self.stages: list[tuple[int, str]] = []  # (index of its first event, phase) for each later phase
        self.reads: GenerationReads | None = None  # answers value reads (generate) while set
        self._known = WeakIdKeyDictionary()

    def begin(self, stage: str) -> None:
        """The run's next phase starts: its peaks start from what is held now."""
        self.stage = stage
        self.stages.append((len(self.events), stage))

    def phase(self) -> str:
        if self.stage != TRAIN:
            return self.stage
        if self.in_optimizer:
            return "optimizer step"
        if torch._C._current_graph_task_id() != -1:  # inside the autograd engine
            # checkpointing reruns the forward with grad mode on; backward proper runs without
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward" if self.started else "build"

    def set_role(self, tensor: torch.Tensor, role: str) -> None:
        known = self._known.get(tensor.untyped_storage())
        if known is not None:
            known[0].role = role

    def settle_build(self) -> None:
        """What the build made and still holds is the model's, whether or not it is a parameter
        or a buffer (a 4-bit layer's quantization statistics hang off its weight)."""
        for entry, _ref in self._known.values():
            if entry.phase == "build" and entry.role is None:
                entry.role = "params"

    def _track(self, tensor: torch.Tensor, nbytes: int | None = None) -> None:
        if tensor.device.type == "meta":  # a shape only (QLoRA's base is built from meta parameters)
            return
        storage = tensor.untyped_storage()
        known = self._known.get(storage)
        nbytes = storage.nbytes() if nbytes is None else nbytes
        phase = self.phase()
        if known is not None:
            entry = known[0]
            if entry.nbytes != nbytes and not entry.corrected:  # resized in place: free the old size, allocate the new
                self.events.append((-1, entry, phase))
                entry.nbytes = nbytes
                self.events.append((1, entry, phase))
            return
        entry = _Storage(nbytes, phase, corrected=nbytes != storage.nbytes())
        events = self.events
        def died(_ref: object, entry: _Storage = entry) -> None:
            events.append((-1, entry, ""))

        ref = weakref.ref(storage, died)
        self._known[storage] = (entry, ref)
        events.append((1, entry, phase))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _LOCAL_SCALAR and self.reads is not None:
            from torch._subclasses.fake_tensor import DataDependentOutputException

            try:
                return func(*args, **(kwargs or {}))  # (a fake tensor made from a Python number knows its value)
            except DataDependentOutputException:
                return self.reads.answer(args[0])
        out = func(*args, **(kwargs or {}))
        if func is _LAYER_NORM and out[1].dtype in _REDUCED and (self.cuda or _fp32_weight(args)):
            # The real kernels keep a bf16/fp16 input's mean and rstd in fp32, the accumulation
            # type (CUDA always; CPU with fp32 weights, not with bf16 ones: pure bf16); the fake
            # kernel makes them in the input's dtype. Seen in a masked-LM head, whose LayerNorm
            # gets autocast's bf16 output.
            self._track(out[0])
            for stat in out[1:]:
                self._track(stat, stat.numel() * 4)
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    @contextlib.contextmanager
    def watching_optimizer(self):
        """Global optimizer hooks: mark the step's allocations, then settle the state's roles."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(optimizer, args, kwargs):
            self.in_optimizer = True

        def post(optimizer, args, kwargs):
            self.in_optimizer = False
            self.optimizer_steps += 1
            fused = bool(optimizer.defaults.get("fused"))
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        # AdamW keeps `step` on the host unless fused or capturable
                        self.set_role(value, "optimizer" if fused or key != "step" else "host")

        handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _role(entry: _Storage) -> str:
    if entry.role is not None:
        return entry.role
    # (what the eval and generate phases make is their forward's: outputs, kept logits, KV cache)
    return "activations" if entry.phase in ("forward", "recompute", EVAL, GENERATE) else "temporaries"


_PHASE_TEXT = {"recompute": "backward (recomputing a checkpointed layer)", "build": "model build",
               EVAL: "evaluation", GENERATE: "generation"}


def replay(events: list, *, cuda: bool, stages: list[tuple[int, str]] | tuple = (),
           left_out: frozenset | set = frozenset()) -> dict:
    """Peak allocated with its breakdown, and the peak reserved: on CUDA by the caching allocator
    model; on CPU as the probe's accountant counts it (each storage rounded up to 512 bytes).

    `stages` marks where the run's later phases begin (index of their first event, phase; the
    training phase begins at 0): each phase's peaks start from what is allocated and reserved as it
    begins, as torch.cuda.reset_peak_memory_stats (and the probe's CPU accountant) start them, and
    the peaks are the largest of the phases'. Phases in `left_out` (not traced to their end) are
    replayed, for what they leave behind, but not counted."""
    allocator = CachingAllocatorModel() if cuda else None
    totals = dict.fromkeys(ROLES, 0)
    total = peak = rounded = 0
    at_peak = dict(totals)
    peak_phase = "forward"
    begins = dict(stages)
    stage = TRAIN
    phase_peaks: dict[str, dict[str, int]] = {}
    stage_peaks = {"allocated": 0, "reserved": 0}

    def reserved_now() -> int:
        return allocator.reserved if allocator is not None else rounded

    for index, (sign, entry, phase) in enumerate(events):
        if index in begins:
            phase_peaks[stage] = stage_peaks
            stage, stage_peaks = begins[index], {"allocated": total, "reserved": reserved_now()}
        role = _role(entry)
        if (cuda and role == "host") or entry.nbytes == 0:
            continue
        if allocator is not None:
            if sign > 0:
                entry.block = allocator.malloc(entry.nbytes)
                size = entry.block.size
            else:
                size = entry.block.size
                allocator.free(entry.block)
                entry.block = None
        else:
            size = entry.nbytes
            rounded += sign * round_to_block(entry.nbytes)  # as the probe's CPU accountant counts
        totals[role if role in totals else "temporaries"] += sign * size
        total += sign * size
        stage_peaks["allocated"] = max(stage_peaks["allocated"], total)
        stage_peaks["reserved"] = max(stage_peaks["reserved"], reserved_now())
        if total > peak and stage not in left_out:
            peak, at_peak, peak_phase = total, dict(totals), phase
    phase_peaks[stage] = stage_peaks
    for index, later in stages:  # (a phase that made nothing: its peaks are what it began with)
        if later not in phase_peaks:
            phase_peaks[later] = {"allocated": total, "reserved": reserved_now()}
    phase_peaks = {name: peaks for name, peaks in phase_peaks.items() if name not in left_out}
    return {
        "peak_bytes": peak,
        "breakdown": at_peak,
        "peak_phase": _PHASE_TEXT.get(peak_phase, peak_phase),
        "reserved_bytes": max(peaks["reserved"] for peaks in phase_peaks.values()),
        "segments": allocator.segments if allocator is not None else 0,
        "phase_peaks": phase_peaks,
    }


def _real_run_mask_rules() -> None:
    """Make transformers choose the attention mask it chooses on real tensors.

    The probe feeds unpadded, unpacked sequences, and transformers answers from their values:
    - `find_packed_sequence_indices` reads the position ids, finds no packing and returns None,
      so SDPA gets `is_causal=True` and no mask. On fake tensors it cannot read them and assumes
      packing, which builds an explicit B x 1 x S x S mask (and would rule out CUDA's flash kernel).
    - an encoder-decoder's decoder (BART, Pegasus) makes a padding mask of ones itself; the SDPA
      skip checks read it, find no padding and skip the mask. A fake padding mask counts as
      "tracing", which keeps the B x 1 x T x T mask (bart at 2 x 64+128: 256 KiB more than measured).
    So answer as a real run of the probe's batches does: no packing, and no padding."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # pragma: no cover - a transformers without the module builds masks otherwise
        return
    from torch._subclasses.fake_tensor import FakeTensor

    if hasattr(masking, "find_packed_sequence_indices"):
        masking.find_packed_sequence_indices = lambda position_ids: None
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None)
        if original is None or getattr(original, "_autotune_unpadded", False):
            continue

        def unpadded(padding_mask, *args, _original=original, **kwargs):
            if isinstance(padding_mask, FakeTensor):
                padding_mask = None  # the probe's batches have no padding: this mask is all ones
            return _original(padding_mask, *args, **kwargs)

        unpadded._autotune_unpadded = True  # type: ignore[attr-defined]
        setattr(masking, name, unpadded)


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


def trace(item: TraceItem, device_type: str, index: int = 0) -> TraceResult:
    """Trace the probe's build and warm-up steps for `item.config` on fake tensors, then the run's
    later phases the probe runs after them (evaluation, generation), predicting `device_type`
    (cuda or cpu); the result is numbered `index`."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from autotune.models import ModelSpec
    from autotune.probe.step import ProbeStep, build_random_model, import_recipe_code, make_optimizer

    started = time.perf_counter()
    config = item.config
    cuda = device_type == "cuda"
    emulation: Any = contextlib.nullcontext()  # CudaKernels when emulating CUDA
    keep = None
    if cuda:
        from autotune.estimate.cuda import CudaKernels, install_cuda_autocast

        keep = install_cuda_autocast()
        emulation = CudaKernels()
    _real_run_mask_rules()
    import_recipe_code(config)  # outside the ledger: those imports make tensors that live on
    # Micro-steps after the second repeat the second one's allocations exactly.
    traced = dataclasses.replace(config, grad_accum=min(config.grad_accum, 2), attention=item.attention)
    device = torch.device("cpu")
    ledger = Ledger(cuda=cuda)
    gc.collect()
    gc.disable()  # storages die when their last reference goes, as in the real step; no stray collections
    try:
        with _adapters_left_in_place(config.peft is not None), _bitsandbytes_maps_made_real(config), \
                older_stacks.four_bit_inputs_kept(item.stack.keeps_4bit_inputs), \
                FakeTensorMode(allow_non_fake_inputs=True), ledger, older_stacks.softmax_inputs_kept(item.stack), \
                ledger.watching_optimizer(), emulation:
            model, hf_config = build_random_model(ModelSpec(traced.model, item.model_config, "trace", item.model_path), traced,
                                                  device, item.trust_remote_code)
            ledger.settle_build()
            for param in model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(lambda p: ledger.set_role(p.grad, "grads"))
            optimizer = make_optimizer(model, device, traced.optimizer, device_type)
            if item.stack.keeps_zeroed_grads:
                older_stacks.zeroing_grads_in_place(optimizer)
            step = ProbeStep(model, optimizer, traced, device, hf_config.vocab_size)
            built = time.perf_counter()
            ledger.started = True
            for _ in range(OPTIMIZER_STEPS):
                steps_before = ledger.optimizer_steps
                try:
                    step()
                except DataDependentOutputException:
                    # ProbeStep ends by reading the loss (`.item()`), which a fake tensor cannot
                    # answer. Anything that reads a value before the step is done is a real failure.
                    # (the step ends with zero_grad: freed gradients, or zeroed ones on a stack that keeps them)
                    freed = item.stack.keeps_zeroed_grads or all(p.grad is None for p in model.parameters())
                    if ledger.optimizer_steps == steps_before or not freed:
                        raise
            unestimated = _later_phases(ledger, step, hf_config.vocab_size) if evaluates(config) else {}
            del step, optimizer, model
    finally:
        gc.enable()
    done = time.perf_counter()
    replayed = replay(ledger.events, cuda=cuda, stages=ledger.stages, left_out=set(unestimated))
    result = TraceResult(
        index=index,
        **replayed,
        build_seconds=round(built - started, 3),
        trace_seconds=round(done - built, 3),
        replay_seconds=round(time.perf_counter() - done, 3),
        events=len(ledger.events),
        kernels=dict(emulation.kernels) if cuda else {},
        torch_version=torch.__version__,
        unestimated=unestimated,
    )
    del keep
    return result


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
    """Trace each requested configuration in turn; one line of answer per configuration."""
    # The heavy imports (torch above, transformers, its mask rules) before the request is read: a
    # search starts this process ahead of its request, so that they overlap its other start-up.
    import transformers  # noqa: F401

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
    request = TraceRequest.from_json(sys.stdin.read())
    for index, item in enumerate(request.items):
        try:
            result = trace(item, request.device_type, index)
        except Exception as exc:  # reported to the parent, which raises EstimateError with it
            sys.stderr.write(traceback.format_exc())
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            failure = TraceFailure(index=index, error_type=type(exc).__name__,
                                   message=f"{type(exc).__name__}: {first}"[:400])
            sys.stdout.write(failure.to_line() + "\n")
            sys.stdout.flush()
            sys.exit(1)
        sys.stdout.write(result.to_line() + "\n")
        sys.stdout.flush()
        gc.collect()
        gc.freeze()  # what the first trace imported lazily (model code), out of every later collection


if __name__ == "__main__":
    main()
