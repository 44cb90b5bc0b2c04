"""Devices as probes and training runs see them: which one to use, what it is, and how fast it
could be (for MFU). Imported only where a probe or a training run starts (it imports torch)."""

from __future__ import annotations

import os

import torch

from autotune.specs.cards import DEVICE_FRAGMENTS
from autotune.host.environment import Environment, cpu_name, openmp_settings, package_version
from autotune.vocabulary.errors import DeviceError

# Dense peak FLOP/s by precision, from the card table (autotune.specs.cards, the one source): fp32 is plain
# FP32 (probes leave TF32 off for it, as PyTorch does by default); tf32 is the TF32 tensor cores'.
# Matched on the lower-cased device name, first match wins: the longer, more specific fragments
# come first ("h100 pcie" before "h100").
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = tuple(
    (fragment, card.peak_flops) for fragment, card in DEVICE_FRAGMENTS
)


def peak_flops(device_name: str, precision: str) -> float | None:
    name = device_name.lower()
    for fragment, table in PEAK_FLOPS:
        if fragment in name:
            return table.get(precision)
    return None


def resolve_device(spec: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' to a torch.device that exists here."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise DeviceError(f"--device {spec!r} is not a device; use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {spec}: CUDA is not available here; use --device cpu (or auto).")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here; use cuda:0..cuda:{torch.cuda.device_count() - 1}."
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise DeviceError(f"--device {spec!r} is not supported; use auto, cpu, cuda or cuda:N.")
    return device


def resolve_training_device(spec: str | None) -> torch.device:
    """`resolve_device` for `autotune train`, where 'auto' is cuda:0 when there is a GPU.

    Trainer trains on cuda:0 and wraps the model in DataParallel when it sees several GPUs, so with
    several the chosen one is made the only one visible (CUDA_VISIBLE_DEVICES), as a probe ran on
    one. CUDA reads that variable when it starts: GPUs are counted through NVML (which does not
    start it) and `resolve_device`, which does, runs after the narrowing.
    """
    text = (spec or "auto").strip().lower()
    count = torch.cuda.device_count()
    if text == "auto":
        text = "cuda" if count else "cpu"
    if count > 1 and text.startswith("cuda"):
        text = _only_visible_gpu(text, count)
    return resolve_device(text)


def _only_visible_gpu(text: str, count: int) -> str:
    """The device string to resolve once the GPU `text` names is the only one CUDA will see."""
    try:
        index = torch.device(text).index or 0
    except RuntimeError:
        return text  # resolve_device says what is wrong with it
    if index >= count:
        return text  # likewise
    if torch.cuda.is_initialized():
        if index != 0:
            raise DeviceError(
                f"--device {text}: CUDA already started in this process; select the GPU with "
                f"CUDA_VISIBLE_DEVICES={index} instead."
            )
        return "cuda:0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]
    return "cuda:0"


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]  # optional; nvidia-ml-py

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML: the driver version is informative only
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().split("Kernel Module")[-1].split()[0]
    except (OSError, IndexError):
        return None


def describe(device: torch.device) -> Environment:
    # A plain str: torch.__version__ is a TorchVersion, whose unpickling imports torch in the parent.
    torch_version, transformers_version = str(torch.__version__), package_version("transformers")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Environment(
            device_type="cuda",
            device_name=props.name,
            device_total_bytes=props.total_memory,
            cuda_version=torch.version.cuda,
            driver_version=_driver_version(),
            torch_version=torch_version,
            transformers_version=transformers_version,
            openmp=openmp_settings(os.environ),
        )
    return Environment(
        device_type="cpu",
        device_name=f"cpu: {cpu_name()}",
        device_total_bytes=host_memory_bytes(),
        torch_version=torch_version,
        transformers_version=transformers_version,
        openmp=openmp_settings(os.environ),
    )


# The FlashAttention kernels take fp16 and bf16 tensors only.
FLASH_ATTENTIONS = ("flash_attention_2", "flash_attention_3")


def supports_attention_dtype(attention: str, precision: str, weights: str) -> str | None:
    """None when the attention kernel can run the tensors `precision` and `weights` make, else why
    not: a lasting skip (the same on every machine), not an error probed again on each resume."""
    if attention in FLASH_ATTENTIONS and precision in ("fp32", "tf32") and weights == "fp32":
        return (
            f"attention {attention} runs fp16 and bf16 tensors only; {precision} with fp32 weights keeps them "
            f"fp32 (use --precisions bf16 or fp16, or --weights bf16)"
        )
    return None


def supports_precision(device: torch.device, precision: str) -> str | None:
    """None when `precision` can run on `device`, else why not."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"bf16 is not supported on {torch.cuda.get_device_name(device)}"
    if precision == "tf32":
        if device.type != "cuda":
            return "tf32 runs matmuls on NVIDIA tensor cores (Ampere and newer): there is no TF32 on CPU"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return (
                f"tf32 needs an NVIDIA GPU of compute capability 8.0 or newer, not {torch.cuda.get_device_name(device)}"
            )
    return None


def gpu_processes(device: torch.device) -> list[tuple[int, int | None]] | None:
    """The processes on `device`'s GPU as NVML sees them, (pid, bytes it holds) each, or None where
    NVML cannot tell (no pynvml / nvidia-ml-py, no driver, a CPU device). NVML names GPUs by UUID,
    so CUDA_VISIBLE_DEVICES' renumbering does not matter."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        found = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except (pynvml.NVMLError, AttributeError, RuntimeError):
        return None
    return [(int(p.pid), int(p.usedGpuMemory) if isinstance(p.usedGpuMemory, int) else None) for p in found]


def other_gpu_processes(device: torch.device) -> int | None:
    """How many other processes share `device`'s GPU (None where NVML cannot tell)."""
    listed = gpu_processes(device)
    return None if listed is None else sum(1 for pid, _ in listed if pid != os.getpid())


def own_gpu_bytes(device: torch.device) -> int | None:
    """What this process holds on `device`'s GPU as NVML counts it (context and allocator together),
    or None where NVML cannot tell: not importable, or this process not listed under its pid (a
    container's own PID namespace hides it)."""
    return process_bytes(gpu_processes(device), os.getpid())


def process_bytes(processes: list[tuple[int, int | None]] | None, pid: int) -> int | None:
    """`pid`'s bytes in an NVML process list (None: no list, not listed, or no figure for it)."""
    return next((used for listed, used in processes or () if listed == pid), None)
