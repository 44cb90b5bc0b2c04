"""Memory accounting and budgets.

On CUDA the caching allocator does the accounting: `set_per_process_memory_fraction` caps what it
may reserve, and its peak statistics say what a probe used. On CPU there is no such allocator, so
`CpuMemoryAccountant` counts every live tensor storage itself (a dispatch mode sees each new
storage; a weakref finalizer sees it die) and raises the same `torch.OutOfMemoryError` past the cap.
That makes every OOM path of the product run on a machine without a GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; counting CPU storages the
# same way makes the CPU "reserved" figure a floor of what the same tensors would reserve on CUDA.
ALLOCATOR_ROUNDING = 512


def round_allocation(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING


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
        self.reserved += round_allocation(nbytes)
        weakref.finalize(storage, self._free, ptr, nbytes)
        if self.reserved > self.peak_reserved:
            if self.cap_bytes is not None and self.reserved > self.cap_bytes:
                # Raise as the CUDA allocator would; the caller's frames then release the tensors.
                wanted = nbytes
                self._free(ptr, nbytes)
                raise torch.OutOfMemoryError(
                    f"CPU budget emulation: out of memory. Tried to allocate {wanted} bytes with "
                    f"{self.reserved} bytes in use of a {self.cap_bytes}-byte cap."
                )
            self.peak_reserved = self.reserved
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _free(self, ptr: int, nbytes: int) -> None:
        if self._live.get(ptr) == nbytes:
            del self._live[ptr]
            self.allocated -= nbytes
            self.reserved -= round_allocation(nbytes)


@dataclass(frozen=True, slots=True)
class CudaBudget:
    """How a budget was applied on a CUDA device."""

    total_bytes: int
    context_bytes: int
    cap_bytes: int


def measure_cuda_context(device: torch.device) -> int:
    """Device memory in use outside PyTorch's caching allocator (CUDA context, cuBLAS handles, ...)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def apply_cuda_budget(device: torch.device, budget_bytes: int, margin_bytes: int) -> CudaBudget:
    """Emulate a card of `budget_bytes`: cap the allocator at budget - context - margin.

    The context is measured after a small matmul so that cuBLAS's handle and workspace exist; it
    grows a little more as kernels load lazily, which is why probes measure it again at the end.
    """
    from autotune.errors import BudgetError
    from autotune.units import format_size

    warm = torch.ones(256, 256, device=device)
    (warm @ warm).sum().item()
    del warm
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes > total:
        raise BudgetError(
            f"--gpu-budget {format_size(budget_bytes)} is larger than {torch.cuda.get_device_name(device)} "
            f"({format_size(total)}); give at most {format_size(total)}."
        )
    context = measure_cuda_context(device)
    cap = budget_bytes - context - margin_bytes
    if cap <= 0:
        raise BudgetError(
            f"--gpu-budget {format_size(budget_bytes)} leaves nothing for training after the CUDA context "
            f"({format_size(context)}) and the safety margin ({format_size(margin_bytes)}); give a larger budget."
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return CudaBudget(total_bytes=total, context_bytes=context, cap_bytes=cap)
