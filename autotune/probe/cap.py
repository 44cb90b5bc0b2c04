"""Holding a training process to a memory budget (autotune.results.budget): the one place where a budget is
enforced, for a probe and for `autotune train` alike.

On CUDA the caching allocator does the accounting: `set_per_process_memory_fraction` caps what it
may reserve at budget - context - margin, and its peak statistics say what was used. On CPU,
`CpuMemoryAccountant` counts every live storage and raises `torch.OutOfMemoryError` past
budget - margin, so every OOM path runs on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any

import torch

from autotune.results.budget import Budget
from autotune.vocabulary.errors import BudgetError
from autotune.probe.devices import host_memory_bytes, own_gpu_bytes
from autotune.probe.memory import CpuMemoryAccountant
from autotune.vocabulary.units import format_size


def measure_cuda_context(device: torch.device) -> int:
    """Device memory this process holds outside PyTorch's caching allocator (the CUDA context, its
    loaded kernels, cuBLAS handles). From NVML's figure for this process where NVML lists it;
    otherwise from the card's used memory, which also counts every other process on the card (a
    killed child not yet released, another job): the cap is then smaller than it should be, never
    larger, and the probe records how many other processes there were (`gpu_processes`)."""
    reserved = torch.cuda.memory_reserved(device)
    own = own_gpu_bytes(device)
    if own is not None:
        return context_bytes(reserved, own_bytes=own)
    free, total = torch.cuda.mem_get_info(device)
    return context_bytes(reserved, card_used_bytes=total - free)


def context_bytes(reserved_bytes: int, *, own_bytes: int | None = None, card_used_bytes: int | None = None) -> int:
    """The memory outside the allocator: what this process holds (NVML) less what its allocator
    reserved, else what the whole card holds less that (an upper bound, with other processes in it)."""
    used = own_bytes if own_bytes is not None else card_used_bytes
    if used is None:
        raise ValueError("context_bytes needs this process's usage or the card's")
    return max(0, used - reserved_bytes)


@dataclass(slots=True)
class MemoryCap:
    """A budget as applied to this process: what the allocator (or the accountant) may hold."""

    device: torch.device
    budget: Budget
    cap_bytes: int
    context_bytes: int  # measured at start on CUDA; 0 on CPU
    accountant: CpuMemoryAccountant | None = None

    def guard(self) -> Any:
        """A context that enforces the cap on CPU (the accountant); nothing to do on CUDA."""
        return self.accountant if self.accountant is not None else contextlib.nullcontext()

    def peaks(self) -> tuple[int | None, int | None]:
        """(peak allocated, peak reserved) bytes so far."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        if self.accountant is not None:
            return self.accountant.peak_allocated, self.accountant.peak_reserved
        return None, None

    def reset_peaks(self) -> None:
        """Start the peaks over from what is held now: the next phase's peaks are its own."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.accountant is not None:
            self.accountant.reset_peaks()

    def context_now(self) -> int:
        """The context outside the allocator: it grows as kernels load lazily, so measure again."""
        if self.device.type != "cuda":
            return 0
        return max(self.context_bytes, measure_cuda_context(self.device))

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)


def cap_memory(device: torch.device, budget: Budget) -> MemoryCap:
    """Emulate a card of `budget`'s size on `device`. Raises BudgetError when the budget cannot be
    honoured here (larger than the card or the host, or nothing left after the context)."""
    budget_bytes, margin_bytes = budget.total_bytes, budget.margin_bytes
    if device.type != "cuda":
        host = host_memory_bytes()
        if host and budget_bytes > host:
            raise BudgetError(
                f"--gpu-budget {format_size(budget_bytes)} is larger than this machine's memory "
                f"({format_size(host)}); give less."
            )
        cap = budget.allowed_bytes
        return MemoryCap(device, budget, cap, 0, CpuMemoryAccountant(cap_bytes=cap))

    torch.cuda.set_device(device)
    gc.collect()
    torch.cuda.empty_cache()
    # A small matmul first, so that cuBLAS's handle and workspace exist when the context is measured.
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
    cap = budget.allowed_bytes - context
    if cap <= 0:
        raise BudgetError(
            f"--gpu-budget {format_size(budget_bytes)} leaves nothing for training after the CUDA context "
            f"({format_size(context)}) and the safety margin ({format_size(margin_bytes)}); give a larger budget."
        )
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    torch.cuda.reset_peak_memory_stats(device)
    return MemoryCap(device, budget, cap, context)
