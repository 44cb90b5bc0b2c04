"""A plan request that runs for minutes (every config of a wide space traced, no cache): for the
service's tests of a plan stopped before its end."""

LONG_PLAN = {
    "model": "tiny",
    "gpu": "a100",
    "micro_batches": "1,2,3,4,5,6,7,8",
    "block_sizes": "16,24,32,48,64",
    "precisions": "fp32,bf16",
    "exact": True,
    "no_cache": True,
}
