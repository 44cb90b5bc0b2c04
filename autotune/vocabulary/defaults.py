"""One default per setting. The dataclasses that hold settings and the CLI's options both read
them here, so that `--help`, the library and a stored study plan never disagree."""

from __future__ import annotations

# -- how a probe runs (ProbeSettings) --------------------------------------------------------
WARMUP_STEPS = 2  # the peak needs the optimizer state, created by the first step
MEASURE_STEPS = 3  # timed optimizer steps, at least
MEASURE_SECONDS = 0.25  # and at least this long a window (a tiny step is timed many times)...
MAX_MEASURE_STEPS = 50  # ...up to this many steps
# A window whose steps spread by more than this (half the interquartile range over the median: a
# busy machine) grows, up to WINDOW_GROWTH times its seconds, before it is taken: one noisy window
# cannot resolve the decision it is for (search/confirm.py measures again what stays noisy).
NOISY_WINDOW = 0.10
WINDOW_GROWTH = 2
PROBE_TIMEOUT_SECONDS = 600.0  # one probe, from a ready child; starting a child is held to it too (at least 60 s)
RENDEZVOUS_SECONDS = 300.0  # the nodes of a multi-node probe waiting for each other (torchrun's own: 600 s)
SAFETY_MARGIN = 0.05  # a fraction of the budget (or bytes when >= 1)
SAFETY_MARGIN_TEXT = "5%"  # the same, as the CLI shows and parses it

# -- what a probe runs (ProbeConfig) ---------------------------------------------------------
PRECISION = "fp32"
ATTENTION = "sdpa"
OPTIMIZER = "adamw"

# -- the search space (SearchSpace) ---------------------------------------------------------
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)  # those up to the effective batch
EFFECTIVE_BATCH = 8  # sequences per optimizer step: Trainer's (micro-batch 8, no accumulation)
BLOCK_SIZE = 512  # Trainer users' usual block; capped by the model's maximum
PRECISIONS = ("fp32", "fp16", "bf16")
CHECKPOINTING = (False, True)
ATTENTIONS = ("sdpa", "eager")

# -- the search (SearchOptions) --------------------------------------------------------------
STRATEGY = "predictive"
# Skip a config only when predicted over the budget by more than this share of it: the stated error
# of the estimator's prediction on each device type. On a CPU it equals the probe to the byte (the
# suite checks it: tests/estimate, tests/test_tasks.py); on CUDA the search uses the worst error
# against published GPU measurements for the study's method (estimate/stated_error.py), and this
# figure only where none is published.
PREDICT_MARGINS = {"cuda": 0.10, "cpu": 0.0}
PREDICT_MARGIN = PREDICT_MARGINS["cuda"]
HEARTBEAT_SECONDS = 5.0  # how often a worker writes its claim's heartbeat
STALE_BEATS = 3  # a claim is stale after this many missed heartbeats
TPE_PATIENCE = 10  # TPE stops after this many probes without a better config

# -- the estimator ---------------------------------------------------------------------------
ESTIMATE_TIMEOUT_SECONDS = 120.0  # per traced configuration

# -- text kept of a failure ------------------------------------------------------------------
ERROR_TAIL_CHARS = 2000  # characters of an error message kept in a result or a run
