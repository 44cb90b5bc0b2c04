"""Memory accounting on CPU.

On CUDA the caching allocator does the accounting (see budget.py). On CPU there is no such
allocator, so `CpuMemoryAccountant` counts every live tensor storage itself (a dispatch mode sees each new
storage; a weakref finalizer sees it die) and raises the same `torch.OutOfMemoryError` past the cap.
That makes every OOM path of the product run on a machine without a GPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# Counting CPU storages as the CUDA allocator rounds them makes the CPU "reserved" figure a floor
# of what the same tensors would reserve on CUDA.
from autotune.vocabulary.units import round_to_block

# How the accountant's own OOM begins (the probe child tells it from a real one by this).
BUDGET_OOM = "CPU budget emulation: out of memory"


class CpuMemoryAccountant(TorchDispatchMode):
    """Counts live tensor storages created while active; raises torch.OutOfMemoryError past `cap_bytes`.

    `allocated` sums exact storage sizes, `reserved` the sizes rounded as the CUDA allocator would.
    Storages created before the mode was entered are not seen: enter it before building the model.
    A storage resized in place (FSDP2 frees a gathered layer's parameters by resizing their storage
    to 0 and gathers into it again) counts at its new size, as the CUDA allocator frees and
    allocates for it. Costs about 40% in step time, so probes time their measured window with it
    switched off.
    """

    def __init__(self, cap_bytes: int | None = None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        # Each storage seen born and not yet dead -> [its bytes now]; a view of one is the same storage.
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._resize = None  # torch.UntypedStorage.resize_ as it was, while this mode watches resizes
        self.watching = False  # entered, and not suspended

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            for tensor in storage_holders(item):
                self._track(tensor.untyped_storage())
        return out

    def __enter__(self):
        resize = self._resize = torch.UntypedStorage.resize_
        accountant = self

        def resize_watched(storage, size):
            out = resize(storage, size)
            accountant._track(storage, born=False)
            return out

        torch.UntypedStorage.resize_ = resize_watched  # type: ignore[method-assign]
        self.watching = True
        return super().__enter__()

    def __exit__(self, *exc_info):
        if not self.watching:
            return None  # suspended: suspend() undid what entering did
        self.watching = False
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        return super().__exit__(*exc_info)

    def suspend(self) -> None:
        """Stop watching, within the `with` that entered it, for steps that repeat the ones it
        watched: its counts stand (a storage it saw freed meanwhile is still counted out, by its
        finalizer; one born and freed meanwhile is never seen), and the ops run at full speed."""
        if self.watching:
            self.__exit__(None, None, None)

    def resume(self) -> None:
        """Watch again after suspend(), within the same `with`."""
        if not self.watching:
            self.__enter__()

    def reset_peaks(self) -> None:
        """The peaks from now on (as torch.cuda.reset_peak_memory_stats): what is live is their start."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def adopt(self, module: torch.nn.Module) -> None:
        """Count the parameters and buffers of a module whose storages were created outside the
        dispatcher (safetensors loading memory-maps them directly), as if born now."""
        for tensor in (*module.parameters(), *module.buffers()):
            for held in storage_holders(tensor):
                self._track(held.untyped_storage())

    def _track(self, storage: torch.UntypedStorage, born: bool = True) -> None:
        """Count a storage an op made (`born`), or one resized in place, at its size now."""
        nbytes = storage.nbytes()
        known = self._live.get(storage)
        if known is None:
            if nbytes == 0 and born:
                return  # empty (and never resized: only FSDP2's resized storages matter at 0 bytes)
            known = self._live[storage] = [0]
            weakref.finalize(storage, self._change, known, 0)
        if known[0] != nbytes:
            self._change(known, nbytes)

    def _change(self, known: list[int], nbytes: int) -> None:
        """A storage's bytes go from known[0] to `nbytes` (0: freed); past the cap, as the CUDA
        allocator would, OutOfMemoryError (and the storage counts as before)."""
        before = known[0]
        self.allocated += nbytes - before
        self.reserved += round_to_block(nbytes) - round_to_block(before)
        known[0] = nbytes
        if nbytes > before and self.reserved > self.peak_reserved:
            if self.cap_bytes is not None and self.reserved > self.cap_bytes:
                # Raise as the CUDA allocator would; the caller's frames then release the tensors.
                in_use = self.reserved
                self._change(known, before)
                raise torch.OutOfMemoryError(
                    f"{BUDGET_OOM}. Tried to allocate {nbytes - before} bytes with "
                    f"{in_use} bytes in use of a {self.cap_bytes}-byte cap."
                )
            self.peak_reserved = self.reserved
        self.peak_allocated = max(self.peak_allocated, self.allocated)


def storage_holders(item: object) -> list[torch.Tensor]:
    """The CPU tensors whose storages an op's output holds: the output itself, or for a wrapper
    subclass (FSDP2's DTensor parameters and gradients) the plain tensors inside it, whose
    storages the ops within the subclass's dispatch make out of this mode's sight."""
    if not isinstance(item, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(item):
        names, _ = item.__tensor_flatten__()
        return [inner for name in names for inner in storage_holders(getattr(item, name))]
    return [item] if item.device.type == "cpu" else []
