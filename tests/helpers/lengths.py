"""Example lengths spread like ms-swift's benchmark data (a long tail), as benchmarks/real_lengths.py
draws them: the data set the padded-run tests share (autotune.levers.lengths)."""

from __future__ import annotations

import math
import random

from autotune.levers.lengths import Lengths

BLOCK = 128


def long_tailed(count: int = 4000, seed: int = 0) -> list[int]:
    """Token counts drawn from a log-normal (median 24, sigma 0.9: mean about 34) cut at the block."""
    rng = random.Random(seed)
    return [max(2, min(BLOCK, round(rng.lognormvariate(math.log(24), 0.9)))) for _ in range(count)]


DATA = long_tailed()
TEXT = Lengths.of(DATA).to_text()  # their quantiles, as a config keeps them
