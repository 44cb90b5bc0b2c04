"""Whether a probe's process may run the next probe.

A warm probe process saves seconds of imports per probe, but only if nothing of one probe reaches
the next, or the next one measures something else than it says. Three things can carry over:

- a fault: after a CUDA OOM the caching allocator stays fragmented and a traceback may hold
  tensors; a device-side assert poisons the CUDA context;
- code patched for every model of a family: Liger replaces RMSNorm, the MLP, the rotary functions
  and the loss in transformers' modeling modules, so a later `liger=off` probe of the same family
  would run Liger's kernels;
- memory the probe left alive (a tensor held by a global or a cache), which the next probe would
  count as its own.

Each ends the process; the parent starts the next probe in a fresh one (its standby, where it keeps
one). Imported only by the probe child (it imports torch).
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from autotune.probe.cap import MemoryCap
from autotune.probe.memory import BUDGET_OOM
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import CLEAN, ProbeStatus

# Modules whose functions and classes a patching library replaces module-wide.
WATCHED_MODULES = ("transformers.models.", "transformers.modeling_", "transformers.loss.", "torch.nn.functional")
# Memory a probe may leave behind without distrusting the process: allocator bookkeeping, a few
# small buffers a library caches once per process (the cuBLAS workspaces are there from the start).
LEFTOVER_TOLERANCE_BYTES = 1 << 20


class CodeWatch:
    """What the watched modules hold, noted once per module, and whether any of it was replaced
    since. A module is noted as soon as it is seen (the child's start, then right after each
    model's build, before Liger is patched in), so a module imported by a probe counts too."""

    def __init__(self) -> None:
        self._noted: dict[str, dict[str, int]] = {}

    def note(self) -> None:
        """Note every watched module not noted yet."""
        for name, module in list(sys.modules.items()):
            if name not in self._noted and module is not None and name.startswith(WATCHED_MODULES):
                self._noted[name] = _contents(module)

    def replaced(self) -> list[str]:
        """The watched names (module.attribute, or module.Class.attribute) replaced since noted."""
        found = []
        for name, before in self._noted.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = _contents(module)
            found += [f"{name}.{attr}" for attr, ident in before.items() if now.get(attr) != ident]
        return found


def _contents(module: ModuleType) -> dict[str, int]:
    """The identity of each function and class a module defines or imports, and of each function in
    the classes it defines ("Class.method"): what a monkey patch replaces."""
    contents: dict[str, int] = {}
    for attr, value in vars(module).items():
        if attr.startswith("__"):
            continue
        if callable(value):
            contents[attr] = id(value)
        if isinstance(value, type) and value.__module__ == module.__name__:
            contents.update(
                {
                    f"{attr}.{method}": id(member)
                    for method, member in vars(value).items()
                    if callable(member) and not method.startswith("__")
                }
            )
    return contents


def allocated_bytes(cap: MemoryCap) -> int:
    """What the probe's memory accounting holds now: the CUDA allocator's allocated bytes, or the
    CPU accountant's live storages (those born while it watched)."""
    if cap.device.type == "cuda":
        return torch.cuda.memory_allocated(cap.device)
    return cap.accountant.allocated if cap.accountant is not None else 0


def why_not_reused(
    result: ProbeResult, device: torch.device, leftover_bytes: int, replaced: list[str], caught_oom: bool = False
) -> str | None:
    """Why this process may not run the next probe after `result`, or None when it may.

    After a CUDA OOM or any fault it may not (see the module's docstring), nor after a CUDA OOM the
    probe caught and went on from (`--eval-batch auto` doubling its eval batch until one fails). The CPU accountant's OOM
    is an exception of our own, raised as the allocation is counted, with every frame released on
    the way out: nothing is left to distrust, and the restart (seconds of imports) is saved. A real
    host OOM still gets a fresh process."""
    if result.status not in CLEAN and not (
        result.status == ProbeStatus.OOM and BUDGET_OOM in (result.error or "") and device.type == "cpu"
    ):
        return f"the probe ended {result.status}"
    if caught_oom and device.type == "cuda":
        return "the probe went on after a CUDA OOM (the largest eval batch found)"
    if replaced:
        shown = ", ".join(replaced[:3]) + (f" and {len(replaced) - 3} more" if len(replaced) > 3 else "")
        return f"the probe replaced module code ({shown})"
    if leftover_bytes > LEFTOVER_TOLERANCE_BYTES:
        return f"the probe left {leftover_bytes:,} bytes allocated"
    return None
