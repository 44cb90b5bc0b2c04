"""What the checks (checks.py) run in their child process, on the card: the cap's OOM, the context
measured three ways (after a step, with a second process holding memory), a device-side assert, the
allocator's two variables, cuBLAS's workspace, bitsandbytes' import, and the hand-off's TrainingArguments
for a compiled fp32 winner. torch is imported inside each function, never here at the top.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from autotune.levers.speed_levers import ALLOC_CONF_VARS
from benchmarks.gpu_evidence.common import GiB, MiB, last_line, one_line


def error_figures(exc: BaseException) -> dict:
    from autotune.probe.oom import is_oom

    text = str(exc)
    return {
        "error_type": f"{type(exc).__module__}.{type(exc).__name__}",
        "message": one_line(text, 500),
        "autotune_says_oom": is_oom(type(exc).__name__, text),
    }


def helper_cap_oom() -> dict:
    """set_per_process_memory_fraction to 2 GiB, 1 GiB taken, then 1.5 GiB more asked for."""
    import torch

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 2 * GiB
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    figures: dict[str, Any] = {
        "alloc_conf": {name: os.environ.get(name) for name in ALLOC_CONF_VARS},
        "cap_bytes": cap,
        "first_bytes": GiB,
        "second_bytes": int(1.5 * GiB),
    }
    first = torch.empty(GiB, dtype=torch.uint8, device=device)
    try:
        second = torch.empty(int(1.5 * GiB), dtype=torch.uint8, device=device)
        figures["raised"] = False
        del second
    except Exception as exc:  # what it raises, if anything, is the measurement
        figures.update(raised=True, is_torch_oom=isinstance(exc, torch.OutOfMemoryError), **error_figures(exc))
    figures["max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del first
    return figures


def context_figures(device: Any) -> dict:
    """The context three ways: NVML's figure for this process, the card's used memory, and
    autotune's own measure_cuda_context (which prefers NVML's); each less the allocator's reserve."""
    import torch

    from autotune.probe.cap import context_bytes, measure_cuda_context
    from autotune.probe.devices import gpu_processes, own_gpu_bytes

    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    own = own_gpu_bytes(device)
    return {
        "reserved_bytes": reserved,
        "card_used_bytes": total - free,
        "nvml_own_bytes": own,
        "context_nvml_bytes": None if own is None else context_bytes(reserved, own_bytes=own),
        "context_card_bytes": context_bytes(reserved, card_used_bytes=total - free),
        "measure_cuda_context_bytes": measure_cuda_context(device),
        "gpu_processes": gpu_processes(device),
        "pid": os.getpid(),
        "pynvml": importlib.util.find_spec("pynvml") is not None,
    }


def gpt2_training_step(device: Any, block: int = 128) -> Callable[[str], float]:
    """gpt2 (124M, random weights) on `device` with fused AdamW: a function doing one optimizer step
    in the precision it is given (fp32, or bf16/fp16 under autocast)."""
    import contextlib

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotune.specs.models import KNOWN_ARCHITECTURES

    fields = {k: v for k, v in KNOWN_ARCHITECTURES["gpt2"].items() if k not in ("model_type", "architectures")}
    model = GPT2LMHeadModel(GPT2Config(**fields)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    ids = torch.randint(0, fields["vocab_size"], (1, block), device=device)

    def step(precision: str) -> float:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        return float(loss)

    return step


def helper_context_after_step() -> dict:
    """One gpt2 training step in fp32, then one under bf16 autocast (more kernels loaded): the
    context after each."""
    import torch

    device = torch.device("cuda", 0)
    step = gpt2_training_step(device)
    step("fp32")
    after_fp32 = context_figures(device)
    step("bf16")
    return {"after_fp32_step": after_fp32, "after_bf16_step": context_figures(device)}


HOLDER = (
    "import sys, torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); "
    "print('ready', flush=True); sys.stdin.read()"
)


def helper_context_with_other_process() -> dict:
    """A second process holds 1 GiB on the card; is it counted in this one's context?"""
    import torch

    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        ready = holder.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the holding process did not start (exit {holder.poll()})")
        device = torch.device("cuda", 0)
        warm = torch.ones(256, 256, device=device)
        (warm @ warm).sum().item()
        figures = context_figures(device)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
    other = GiB
    figures.update(
        other_process_bytes=other,
        holder_pid=holder.pid,
        counts_other_process=figures["measure_cuda_context_bytes"] >= other,
    )
    return figures


def helper_device_assert() -> dict:
    """An out-of-range index on CUDA (a device-side assert), then torch.cuda.mem_get_info."""
    import torch

    x = torch.zeros(8, device="cuda")
    index = torch.tensor([1000], device="cuda")
    figures: dict[str, Any] = {}
    try:
        x[index].sum().item()
        torch.cuda.synchronize()
        figures["assert_raised"] = False
    except Exception as exc:  # the device-side assert is expected here
        figures.update(assert_raised=True, assert_error=error_figures(exc))
    try:
        free, total = torch.cuda.mem_get_info()
        figures["mem_get_info"] = {"raises": False, "free_bytes": free, "total_bytes": total}
    except Exception as exc:  # whether it raises is the question
        figures["mem_get_info"] = {"raises": True, **error_figures(exc)}
    try:
        figures["memory_reserved_after"] = {"raises": False, "bytes": torch.cuda.memory_reserved()}
    except Exception as exc:  # the allocator's own counters need no device call: do they still answer?
        figures["memory_reserved_after"] = {"raises": True, **error_figures(exc)}
    return figures


def helper_allocator_settings() -> dict:
    """Whether this process's allocator runs expandable segments: the snapshot's `is_expandable`
    where torch reports it, else 8 large blocks in one segment (expandable) or eight."""
    import torch

    device = torch.device("cuda", 0)
    blocks = [torch.empty(32 * MiB, dtype=torch.uint8, device=device) for _ in range(8)]
    segments = torch.cuda.memory_snapshot()
    large = [s for s in segments if s.get("segment_type") == "large"]
    flags = sorted({bool(s["is_expandable"]) for s in segments if "is_expandable" in s})
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = None
    if getter is not None:
        try:
            settings = str(getter())
        except Exception as exc:  # a private API: record what it said
            settings = f"raised {type(exc).__name__}: {one_line(str(exc))}"
    del blocks
    return {
        "env": {name: os.environ.get(name) for name in ALLOC_CONF_VARS},
        "large_segments": len(large),
        "is_expandable_flags": flags,
        "allocator_settings": settings,
        "expandable": flags == [True] if flags else len(large) == 1,
    }


def helper_cublas_workspace() -> dict:
    """cuBLAS's workspaces in a fresh process: allocated bytes a first fp32 matmul and its backward
    add beyond their tensors, and what clearing the workspaces gives back."""
    import torch

    device = torch.device("cuda", 0)
    a = torch.randn(1024, 1024, device=device, requires_grad=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    c = a @ a
    torch.cuda.synchronize(device)
    forward = torch.cuda.memory_allocated(device) - before - c.numel() * c.element_size()
    c.sum().backward()
    torch.cuda.synchronize(device)
    assert a.grad is not None
    live = c.numel() * c.element_size() + a.grad.numel() * a.grad.element_size()
    after_backward = torch.cuda.memory_allocated(device) - before - live
    # What the estimator adds is what is allocated beyond the tensors once a step's forward and
    # backward have run (two threads, two handles); clearing the workspaces is the cross-check.
    figures: dict[str, Any] = {
        "forward_workspace_bytes": forward,
        "after_backward_workspace_bytes": after_backward,
        "workspace_bytes": after_backward,
    }
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        held = torch.cuda.memory_allocated(device)
        clear()
        figures["cleared_bytes"] = held - torch.cuda.memory_allocated(device)
    figures["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return figures


def helper_bitsandbytes_import() -> dict:
    """Does importing bitsandbytes start CUDA in this process (a context of its own)?"""
    import torch

    before = torch.cuda.is_initialized()
    import bitsandbytes

    figures: dict[str, Any] = {
        "bitsandbytes": getattr(bitsandbytes, "__version__", None),
        "cuda_initialized_before": before,
        "cuda_initialized_after": torch.cuda.is_initialized(),
    }
    try:  # NVML by index: asking torch for the device's UUID would start CUDA itself
        import pynvml  # type: ignore[import-not-found]  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        listed = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        figures.update(nvml_lists_this_process=os.getpid() in listed, nvml_own_bytes=listed.get(os.getpid()))
    except Exception as exc:  # no NVML here: the torch flag above is the answer
        figures["nvml"] = f"unavailable: {type(exc).__name__}: {one_line(str(exc))}"
    return figures


def helper_handoff_compile(model_dir: str, output_dir: str, drop_tf32: bool) -> dict:
    """Two Trainer steps of the tiny GPT-2 with the hand-off's TrainingArguments for a compiled fp32
    winner (drop_tf32: without the `tf32` the hand-off always names)."""
    import torch
    import transformers
    from transformers import AutoConfig, Trainer, TrainingArguments

    from autotune.levers.config import ProbeConfig
    from autotune.handoff import BestConfig
    from autotune.store import LeaderboardRow

    config = ProbeConfig(model=model_dir, micro_batch=2, block_size=64, precision="fp32", compile=True)
    row = LeaderboardRow(
        rank=1,
        study="gpu-evidence",
        probe_id=0,
        trial_number=None,
        config=config,
        config_key=config.key(),
        status="ok",
        tokens_per_s=None,
        step_seconds=None,
        samples_per_s=None,
        mfu=None,
        peak_allocated_bytes=None,
        peak_reserved_bytes=None,
        context_bytes=None,
        budget_bytes=8 * GiB,
        margin_bytes=0,
    )
    best = BestConfig(row, device_type="cuda")
    kwargs = best.trainer_kwargs()
    if drop_tf32:
        kwargs.pop("tf32", None)
    figures: dict[str, Any] = {
        "trainer_kwargs": kwargs,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    args = TrainingArguments(
        output_dir=output_dir, max_steps=2, report_to="none", save_strategy="no", logging_steps=1, **kwargs
    )
    model = best.load_model(AutoConfig.from_pretrained(model_dir))
    vocab = model.config.vocab_size
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (8, 64))]
    try:
        result = Trainer(model=model, args=args, train_dataset=data).train()
        figures.update(ok=True, train_loss=result.training_loss)
    except Exception as exc:  # the error (torch.compile refusing mixed TF32 APIs) is the finding
        figures.update(ok=False, **error_figures(exc), message_tail=last_line(str(exc), 500))
    for name in ("fp32_precision", "allow_tf32"):
        try:
            figures[f"matmul_{name}"] = str(getattr(torch.backends.cuda.matmul, name))
        except Exception as exc:  # reading the legacy flag beside the new API can raise
            figures[f"matmul_{name}"] = f"raised {type(exc).__name__}: {one_line(str(exc))}"
    return figures
