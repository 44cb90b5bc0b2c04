"""Which failures mean "out of memory". One pure function over the exception's type name and its
message, so that it is testable on canned strings and usable in the parent on text alone."""

from __future__ import annotations

from autotune.vocabulary.status import ProbeStatus

# Lower-cased fragments that mean the device ran out of memory, whatever library raised it.
OOM_MESSAGES = (
    "out of memory",  # torch.OutOfMemoryError, "CUDA error: out of memory", HIP
    "cuda_error_out_of_memory",  # driver API name in NCCL/cuBLASLt traces
    "cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
    "cublas_status_not_initialized",  # cuBLAS handle creation fails when memory is exhausted
    "cudnn_status_alloc_failed",
    "cudnn_status_not_supported. this error may appear if you passed in a non-contiguous input",  # cuDNN's OOM-in-disguise
    "cufft_alloc_failed",
    "cusolver_status_alloc_failed",
    "failed to allocate memory",  # XLA/MPS wording
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
)
OOM_TYPES = ("OutOfMemoryError", "MemoryError")


def is_oom(type_name: str, message: str) -> bool:
    """True when an exception of this type and message means the device ran out of memory."""
    if type_name.rsplit(".", 1)[-1] in OOM_TYPES:
        return True
    text = message.lower()
    return any(fragment in text for fragment in OOM_MESSAGES)


def classify_exception(exc: BaseException) -> ProbeStatus:
    """OOM or ERROR for an exception raised while probing."""
    return ProbeStatus.OOM if is_oom(type(exc).__name__, str(exc)) else ProbeStatus.ERROR
