"""Memory accounting on CPU.

On CUDA the caching allocator does the accounting (see budget.py). On CPU there is no such
allocator, so `CpuMemoryAccountant` counts every live tensor storage itself (a dispatch mode sees each new
storage; a weakref finalizer sees it die) and raises the same `torch.OutOfMemoryError` past the cap.
That makes every OOM path of the product run on a machine without a GPU.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Counting CPU storages as the CUDA allocator rounds them makes the CPU "reserved" figure a floor
# of what the same tensors would reserve on CUDA.
from autotune.units import round_to_block

# How the accountant's own OOM begins (the probe child tells it from a real one by this).
BUDGET_OOM = "CPU budget emulation: out of memory"


class CpuMemoryAccountant(TorchDispatchMode):
    """Counts live tensor storages created while active; raises torch.OutOfMemoryError past `cap_bytes`.

    `allocated` sums exact storage sizes, `reserved` the sizes rounded as the CUDA allocator would.
    Storages created before the mode was entered are not seen: enter it before building the model.
    Costs about 40% in step time, so probes time their measured window with it switched off.
    """

    def __init__(self, cap_bytes: int | None = None) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._live: dict[int, int] = {}  # data_ptr -> nbytes of storages we saw born and not yet die

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu":
                self._track(item.untyped_storage())
        return out

    def reset_peaks(self) -> None:
        """The peaks from now on (as torch.cuda.reset_peak_memory_stats): what is live is their start."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def adopt(self, module: torch.nn.Module) -> None:
        """Count the parameters and buffers of a module whose storages were created outside the
        dispatcher (safetensors loading memory-maps them directly), as if born now."""
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.device.type == "cpu":
                self._track(tensor.untyped_storage())

    def _track(self, storage: torch.UntypedStorage) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self._live:
            return  # empty, or a view of a storage already counted
        self._live[ptr] = nbytes
        self.allocated += nbytes
        self.reserved += round_to_block(nbytes)
        weakref.finalize(storage, self._free, ptr, nbytes)
        if self.reserved > self.peak_reserved:
            if self.cap_bytes is not None and self.reserved > self.cap_bytes:
                # Raise as the CUDA allocator would; the caller's frames then release the tensors.
                wanted = nbytes
                self._free(ptr, nbytes)
                raise torch.OutOfMemoryError(
                    f"{BUDGET_OOM}. Tried to allocate {wanted} bytes with "
                    f"{self.reserved} bytes in use of a {self.cap_bytes}-byte cap."
                )
            self.peak_reserved = self.reserved
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _free(self, ptr: int, nbytes: int) -> None:
        if self._live.get(ptr) == nbytes:
            del self._live[ptr]
            self.allocated -= nbytes
            self.reserved -= round_to_block(nbytes)
