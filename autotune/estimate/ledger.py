"""The trace child's ledger: every storage the traced run creates, in order, with the moment it is
freed or resized, and the replay of those events into peaks (allocated, reserved, and what was
live at the peak by role).

The ledger counts what the probe's CPU accountant (`autotune.probe.memory.CpuMemoryAccountant`)
counts, so that a CPU estimate equals a CPU probe to the byte: the storages inside a wrapper
subclass's outputs (FSDP2's DTensor parameters and gradients), and storages resized in place
(FSDP2 frees a gathered unit's parameters with `UntypedStorage.resize_(0)` and gathers into the
same storage again). Each event carries the storage's size at that moment, since a resized storage
has several sizes over its life.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autotune.estimate.allocator import CachingAllocatorModel
from autotune.estimate.generation import GenerationReads
from autotune.levers.evaluation import EVAL, GENERATE, TRAIN
from autotune.probe.memory import storage_holders
from autotune.vocabulary.units import round_to_block

ROLES = ("params", "grads", "optimizer", "activations", "temporaries")
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_REDUCED = (torch.bfloat16, torch.float16)
# Fake tensors cannot be pinned (fsdp-offload pins its host shards): a copy stands in, as pinning makes one.
_PIN = torch.ops.aten._pin_memory.default
_IS_PINNED = torch.ops.aten.is_pinned.default


@dataclass(eq=False, slots=True)
class _Storage:
    nbytes: int
    phase: str
    role: str | None = None  # settled when known: params, grads, optimizer, host (not on the GPU)
    block: object = None  # the allocator model's block while replaying
    corrected: bool = False  # its size is the real kernel's, not the fake storage's (see Ledger)


def _fp32_weight(args: tuple) -> bool:
    weight = args[2] if len(args) > 2 else None
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


def _is_reduce_scatter(func) -> bool:
    return getattr(func, "namespace", None) == "c10d" and "reduce_scatter" in func.__name__


class Ledger(TorchDispatchMode):
    """Records, in order, every storage an op creates and the moment it is freed or resized, with
    the phase of the step it happened in: build, forward, backward, recompute (checkpointing) or
    optimizer; after the training steps, the run's later phases (autotune.levers.evaluation: eval,
    generate), each begun with `begin`, so that the replay can tell each one's peaks.

    Events are (+1 born / -1 freed, storage, phase, its bytes then)."""

    def __init__(self, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda  # predicting CUDA kernels (else CPU ones)
        self.started = False  # False while the model is being built
        self.in_optimizer = False
        self.optimizer_steps = 0
        self.events: list[tuple[int, _Storage, str, int]] = []
        self.stage = TRAIN  # the run's phase (autotune.levers.evaluation) in progress
        self.stages: list[tuple[int, str]] = []  # (index of its first event, phase) for each later phase
        self.reads: GenerationReads | None = None  # answers value reads (generate) while set
        # While set, ops with no fake input make real tensors: the bookkeeping of DDP's C++ reducer
        # reads the values of the small tensors it makes (estimate/ranks.py), which fakes cannot give.
        self.real_factories = False
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

    def repeat_events_from(self, start: int) -> bool:
        """Append a copy of the events from `start` on (one optimizer step's), as the next step
        makes them: each storage born and freed in that window is born and freed again, in the
        same order, at the same sizes, with the same roles; a storage born there that outlives it
        (optimizer state, a scaler's scale: made once) is not made again. False, appending nothing,
        where the window touches a storage made before it (freed or resized): such a step is not a
        repeat of itself, and the next one must be traced."""
        window = self.events[start:]
        born = {id(entry) for sign, entry, *_ in window if sign > 0}
        if any(id(entry) not in born for _, entry, *_ in window):
            return False
        balance: dict[int, int] = {}
        for sign, entry, *_ in window:
            balance[id(entry)] = balance.get(id(entry), 0) + sign
        copies: dict[int, _Storage] = {}
        for sign, entry, phase, nbytes in window:
            if balance[id(entry)] != 0:
                continue  # outlives the step: made once
            copy = copies.get(id(entry))
            if copy is None:
                copy = copies[id(entry)] = _Storage(entry.nbytes, entry.phase, entry.role, corrected=entry.corrected)
            self.events.append((sign, copy, phase, nbytes))
        self.optimizer_steps += 1
        return True

    def set_role(self, tensor: torch.Tensor, role: str) -> None:
        for held in storage_holders(tensor):
            known = self._known.get(held.untyped_storage())
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
        self._track_storage(storage, storage.nbytes() if nbytes is None else nbytes, corrected=nbytes is not None)

    def _track_storage(self, storage: torch.UntypedStorage, nbytes: int, corrected: bool = False) -> None:
        known = self._known.get(storage)
        phase = self.phase()
        if known is not None:
            entry = known[0]
            if entry.nbytes != nbytes and not entry.corrected:  # resized in place: free the old size, allocate the new
                self.events.append((-1, entry, phase, entry.nbytes))
                entry.nbytes = nbytes
                self.events.append((1, entry, phase, nbytes))
            return
        entry = _Storage(nbytes, phase, corrected=corrected and nbytes != storage.nbytes())
        events = self.events

        def died(_ref: object, entry: _Storage = entry) -> None:
            events.append((-1, entry, "", entry.nbytes))

        ref = weakref.ref(storage, died)
        self._known[storage] = (entry, ref)
        events.append((1, entry, phase, nbytes))

    def transient(self, nbytes: int) -> None:
        """A buffer allocated and freed at once, out of the dispatcher's sight (a collective's copy)."""
        entry = _Storage(nbytes, self.phase())
        self.events += [(1, entry, entry.phase, nbytes), (-1, entry, "", nbytes)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _LOCAL_SCALAR and self.reads is not None:
            from torch._subclasses.fake_tensor import DataDependentOutputException

            try:
                return func(*args, **(kwargs or {}))  # (a fake tensor made from a Python number knows its value)
            except DataDependentOutputException:
                return self.reads.answer(args[0])
        if func is _PIN:
            func, args, kwargs = torch.ops.aten.clone.default, args[:1], {}
        elif func is _IS_PINNED and _any_fake((args, kwargs)):
            return True
        if not self.cuda and _is_reduce_scatter(func):
            # gloo has no reduce-scatter of its own: it reduces a copy of the input (made on the
            # calling thread, as the CPU probe's accountant sees) and scatters from it.
            self.transient(
                sum(t.untyped_storage().nbytes() for t in tree_leaves((args[1],)) if isinstance(t, torch.Tensor))
            )
        if self.real_factories and not _any_fake((args, kwargs)):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                out = func(*args, **(kwargs or {}))
        else:
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
            for held in storage_holders(leaf):
                self._track(held)
        return out

    @contextlib.contextmanager
    def watching_resizes(self):
        """Count storages resized in place (`UntypedStorage.resize_`, which no dispatch mode
        sees) at their new size, as the probe's accountant does."""
        resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_watched(storage, size):
            out = resize(storage, size)
            if size > 0 or storage in ledger._known:  # (a fake tensor's storage is on the meta device)
                ledger._track_storage(storage, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_watched  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]

    @contextlib.contextmanager
    def watching_optimizer(self, state_role: str | None = None, grads_role: str = "grads"):
        """Global optimizer hooks: mark the step's allocations, then settle the roles of the
        gradients it steps with (FSDP2 sets its sharded gradients where no gradient hook sees them)
        and of its state (`state_role`: all of it, "host" for an offloaded optimizer)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(optimizer, args, kwargs):
            self.in_optimizer = True
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self.set_role(param.grad, grads_role)

        def post(optimizer, args, kwargs):
            self.in_optimizer = False
            self.optimizer_steps += 1
            fused = bool(optimizer.defaults.get("fused"))
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        # AdamW keeps `step` on the host unless fused or capturable
                        self.set_role(value, state_role or ("optimizer" if fused or key != "step" else "host"))

        handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _any_fake(tree) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(leaf, FakeTensor) for leaf in tree_leaves(tree))


def _role(entry: _Storage) -> str:
    if entry.role is not None:
        return entry.role
    # (what the eval and generate phases make is their forward's: outputs, kept logits, KV cache)
    return "activations" if entry.phase in ("forward", "recompute", EVAL, GENERATE) else "temporaries"


_PHASE_TEXT = {
    "recompute": "backward (recomputing a checkpointed layer)",
    "build": "model build",
    EVAL: "evaluation",
    GENERATE: "generation",
}


def replay(
    events: list, *, cuda: bool, stages: list[tuple[int, str]] | tuple = (), left_out: frozenset | set = frozenset()
) -> dict:
    """Peak allocated with its breakdown, and the peak reserved: on CUDA by the caching allocator
    model; on CPU as the probe's accountant counts it (each storage rounded up to 512 bytes).

    `events` are the Ledger's (sign, storage, phase, bytes); without the bytes, the storage's own.
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

    for index, (sign, entry, phase, *sized) in enumerate(events):
        if index in begins:
            phase_peaks[stage] = stage_peaks
            stage, stage_peaks = begins[index], {"allocated": total, "reserved": reserved_now()}
        role = _role(entry)
        nbytes = sized[0] if sized else entry.nbytes
        if (cuda and role == "host") or nbytes == 0:
            continue
        if allocator is not None:
            if sign > 0:
                entry.block = allocator.malloc(nbytes)
                size = entry.block.size
            else:
                if entry.block is None:
                    continue
                size = entry.block.size
                allocator.free(entry.block)
                entry.block = None
        else:
            size = nbytes
            rounded += sign * round_to_block(nbytes)  # as the probe's CPU accountant counts
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
