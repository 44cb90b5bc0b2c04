"""Can a deep decoder's memory be told from two shallow copies of it? Measured, and the answer
kept in docs/plan.md ("Why not fewer layers"): the peak allocated, yes; the peak reserved, no.

A trace's time grows with the model's layers (a 7B Llama's 32: 10-25 s a trace on one core), which
is what keeps `autotune plan` of a 7B near three minutes on two cores. The layers of a decoder are
alike, so each figure was carried along the line through traces at 2 and 3 layers to the model's
depth and set against the trace of the whole model. Each row prints both ratios and the seconds of
the full trace against the two shallow ones (one core; a warm process).

    python -m benchmarks.layer_extrapolation            # 1B and 7B rows, ~5 min on 2 cores
    python -m benchmarks.layer_extrapolation --sweep    # one 1B config's reserved memory by depth
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autotune.estimate.protocol import TraceItem, TraceResult
from autotune.levers.config import ProbeConfig
from autotune.specs.models import resolve_model

MODELS = Path(__file__).parent / "published" / "models"
LLAMA_7B = str(MODELS / "meta-llama--Llama-2-7b-hf")
LLAMA_1B = str(MODELS / "meta-llama--Llama-3.2-1B")
LORA = "lora r=8 alpha=16 dropout=0.05 targets=all-linear"
SHALLOW = (2, 3)

ROWS = {
    "1B full mb1 blk1024": ProbeConfig(LLAMA_1B, 1, 1024, precision="bf16"),
    "1B full mb8x2 blk1024": ProbeConfig(LLAMA_1B, 8, 1024, grad_accum=2, precision="bf16"),
    "1B full mb8 blk1024 ckpt": ProbeConfig(LLAMA_1B, 8, 1024, precision="bf16", checkpointing=True),
    "1B full mb4 blk512 fp32": ProbeConfig(LLAMA_1B, 4, 512, precision="fp32"),
    "1B full mb2 blk1024 2xddp": ProbeConfig(LLAMA_1B, 2, 1024, precision="bf16", gpus=2, strategy="ddp"),
    "1B full mb2 blk1024 4xfsdp": ProbeConfig(LLAMA_1B, 2, 1024, precision="bf16", gpus=4, strategy="fsdp"),
    "7B lora mb4x2 blk512": ProbeConfig(LLAMA_7B, 4, 512, grad_accum=2, precision="bf16", peft=LORA, weights="bf16"),
    "7B lora mb16 blk512 ckpt": ProbeConfig(
        LLAMA_7B, 16, 512, precision="bf16", peft=LORA, weights="bf16", checkpointing=True
    ),
    "7B lora mb2x2 blk512 2xddp": ProbeConfig(
        LLAMA_7B, 2, 512, grad_accum=2, precision="bf16", peft=LORA, weights="bf16", gpus=2, strategy="ddp"
    ),
    "7B full mb2 blk512": ProbeConfig(LLAMA_7B, 2, 512, precision="bf16"),
}


def traced(config: ProbeConfig, layers: int | None = None) -> tuple[TraceResult, float]:
    """The CUDA trace of `config`, its model cut to `layers` layers (None: as it is), and its seconds."""
    from autotune.estimate.trace import trace

    spec = resolve_model(config.model)
    model_config = spec.config if layers is None else {**spec.config, "num_hidden_layers": layers}
    started = time.perf_counter()
    result = trace(TraceItem(config, model_config, spec.path if layers is None else None), "cuda")
    return result, time.perf_counter() - started


def along_the_line(low: int, high: int, layers: int) -> float:
    return (layers - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0]) * (high - low) + low


def rows() -> None:
    traced(ROWS["1B full mb1 blk1024"], 2)  # (the imports and the model code, out of the first row)
    for name, config in ROWS.items():
        layers = resolve_model(config.model).config["num_hidden_layers"]
        (low, low_s), (high, high_s), (full, full_s) = (traced(config, n) for n in (*SHALLOW, None))
        peak = along_the_line(low.peak_bytes, high.peak_bytes, layers) / full.peak_bytes
        reserved = along_the_line(low.reserved_bytes, high.reserved_bytes, layers) / full.reserved_bytes
        print(
            f"{name:28s} peak allocated x{peak:.5f}  peak reserved x{reserved:.4f} "
            f"(full: {full.peak_bytes / 2**30:6.2f} and {full.reserved_bytes / 2**30:6.2f} GiB)  "
            f"{full_s:5.1f} s vs {low_s + high_s:4.1f} s",
            flush=True,
        )


def sweep() -> None:
    config = ROWS["1B full mb8 blk1024 ckpt"]
    print("layers  peak allocated GiB  peak reserved GiB  reserved - allocated")
    for layers in (2, 3, 4, 5, 6, 8, 10, 12, 16):
        result, _ = traced(config, layers)
        print(
            f"{layers:6d}  {result.peak_bytes / 2**30:18.3f}  {result.reserved_bytes / 2**30:17.3f}  "
            f"{(result.reserved_bytes - result.peak_bytes) / 2**30:19.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="one config's memory by depth, 2 to 16 layers")
    args = parser.parse_args()
    sweep() if args.sweep else rows()


if __name__ == "__main__":
    main()
