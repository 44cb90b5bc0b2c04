import pytest

from autotune.probe.oom import classify_exception, is_oom


@pytest.mark.parametrize(
    "type_name, message",
    [
        (
            "torch.OutOfMemoryError",
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB",
        ),
        ("OutOfMemoryError", "anything at all"),
        ("RuntimeError", "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        ("RuntimeError", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        ("RuntimeError", "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
        ("RuntimeError", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        ("RuntimeError", "HIP out of memory. Tried to allocate 20.00 MiB"),
        ("RuntimeError", "MPS backend out of memory (MPS allocated: 1.2 GB)"),
        (
            "RuntimeError",
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes.",
        ),
        ("MemoryError", ""),
        ("NCCLError", "NCCL error: unhandled cuda error, NCCL version 2.21.5; Cuda failure 'CUDA_ERROR_OUT_OF_MEMORY'"),
    ],
)
def test_out_of_memory_wordings_are_oom(type_name, message):
    assert is_oom(type_name, message)


@pytest.mark.parametrize(
    "type_name, message",
    [
        ("RuntimeError", "CUDA error: device-side assert triggered"),
        ("RuntimeError", "CUDA error: an illegal memory access was encountered"),
        ("ValueError", "Input length of input_ids is 2048, but max_length is set to 1024"),
        ("RuntimeError", "shape '[8, 512, 12, 64]' is invalid for input of size 100"),
        ("KeyError", "'memory'"),
    ],
)
def test_other_failures_are_errors(type_name, message):
    assert not is_oom(type_name, message)


def test_classify_exception_uses_type_and_message():
    assert classify_exception(RuntimeError("CUDA error: out of memory")) == "oom"
    assert classify_exception(MemoryError()) == "oom"
    assert classify_exception(RuntimeError("device-side assert triggered")) == "error"
