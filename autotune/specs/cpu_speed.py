"""How long training takes on this CPU, told without torch: a configuration's FLOPs per step
(autotune.specs.flops over the model's sizes, autotune.specs.shapes) over this host's measured matmul speed
(numpy, a fraction of a second), so that a command about to train on the CPU can say what it would
cost before it starts."""

from __future__ import annotations

import time
from dataclasses import dataclass

from autotune.levers.config import ProbeConfig
from autotune.specs.flops import flops_per_token
from autotune.specs.shapes import ModelDims
from autotune.vocabulary.units import format_duration

# Share of the plain float32 matmul speed a CPU training step reaches (attention, norms,
# optimizer and Python in between). Measured on a 2-core AMD EPYC (torch 2.13, numpy matmul at
# 190 GFLOP/s): gpt2 at micro-batch 1, block 128 reached 0.36 of it, micro-batch 8, block 64 0.54.
TRAINING_SHARE = 0.4


def matmul_flops_per_s(seconds: float = 0.15, n: int = 512) -> float:
    """This host's float32 matmul speed (FLOP/s), measured for about `seconds` with numpy."""
    import numpy as np

    a = np.ones((n, n), dtype=np.float32)
    a @ a  # (the first call loads the BLAS library's threads)
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or not done:
        a @ a
        done += 1
    return 2 * n**3 * done / elapsed


@dataclass(frozen=True, slots=True)
class CpuCost:
    """What training `config` costs on this CPU."""

    step_seconds: float  # one optimizer step
    flops_per_s: float  # the host's measured matmul speed

    def describe_probe(self, steps: int) -> str:
        return f"about {format_duration(self.step_seconds * steps)} a probe ({steps} optimizer steps)"


def cpu_cost(config: ProbeConfig, dims: ModelDims, flops_per_s: float | None = None) -> CpuCost:
    """The predicted seconds per optimizer step of `config` on this CPU (the matmul speed measured
    unless given). A model, not a measurement: within a factor of two, enough to say minutes or hours."""
    speed = flops_per_s if flops_per_s is not None else matmul_flops_per_s()
    trained = dims.trainable_parameters if dims.trainable_parameters is not None else dims.parameters
    per_token = flops_per_token(
        dims.parameters, trained, dims.layers, dims.hidden, config.block_size, recompute=config.checkpointing
    )
    # (padding included: the positions computed, autotune.levers.lengths)
    return CpuCost(step_seconds=config.padded_tokens_per_step * per_token / (speed * TRAINING_SHARE), flops_per_s=speed)
