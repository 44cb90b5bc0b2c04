"""`plan`'s speed model on this CPU against the CPU demo's own measured probes: reported, not tuned.

The speed model prices a card from its published peaks (autotune/planner/card_speed.py). A CPU has no
data sheet here, so this one is measured now: its float32 and bfloat16 matmul FLOP/s (torch, the
probes' own kernels) and its copy bandwidth. Each stored probe of a study (benchmarks/results/studies/
*.json, measured on this kind of machine) is predicted with the same model and constants as a GPU
plan; the report gives each config's predicted / measured tokens/s, and the same ratio relative to
the study's fastest config (what ranking needs). No constant is fitted here.

    python -m benchmarks.cpu_plan [benchmarks/results/studies/cpu-amd-epyc-demo-gpt2-2026-11-25.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT = Path(__file__).parent / "results" / "studies" / "cpu-amd-epyc-demo-gpt2-2026-11-25.json"
DEMO_MODEL = {"model_type": "gpt2", "n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 50257, "n_positions": 1024}


def measured_cpu() -> tuple[dict[str, float], float]:
    """This CPU's matmul FLOP/s by precision and its copy bandwidth (bytes/s), measured with torch."""
    import torch

    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x, w = torch.ones(512, 1024, dtype=dtype), torch.ones(1024, 1024, dtype=dtype)
        torch.nn.functional.linear(x, w)  # (a linear layer's kernel, as the probes' matmuls run)
        done, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < 0.5:
            torch.nn.functional.linear(x, w)
            done += 1
        peaks[name] = 2 * 512 * 1024 * 1024 * done / elapsed
    big = torch.ones(64 * 2**20 // 4)
    out = torch.empty_like(big)
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < 0.5:
        out.copy_(big)
        done += 1
    return peaks, 2 * big.numel() * 4 * done / elapsed


def main(argv: list[str] | None = None) -> int:
    from autotune.specs.cards import Card
    from autotune.levers.config import ProbeConfig
    from autotune.planner.card_speed import predict_step_seconds
    from autotune.specs.shapes import dims_from_config

    path = Path((argv or sys.argv[1:] or [str(DEFAULT)])[0])
    study = json.loads(path.read_text())
    peaks, bandwidth = measured_cpu()
    # (the GPU model's efficiencies apply: the measured matmul speed stands as the "peak")
    cpu = Card(
        "this CPU",
        ("cpu",),
        0,
        {"fp32": peaks["fp32"], "bf16": peaks["bf16"], "fp16": peaks["bf16"]},
        bandwidth,
        (8, 0),
        (),
        host_is_device=True,
    )
    dims = dims_from_config(DEMO_MODEL)
    assert dims is not None
    rows = []
    skipped = 0
    for probe in study["probes"]:
        result = probe["result"]
        if result["status"] != "ok":
            continue
        if probe["config"]["precision"] != "fp32":
            # This CPU's bf16 matmuls run far below its fp32 ones in isolation (printed), yet its bf16
            # probes measured faster: the model cannot price what the CPU's autocast does. fp32 only.
            skipped += 1
            continue
        config = ProbeConfig.from_dict({**probe["config"], "model": "demo"})
        predicted = predict_step_seconds(config, dims, cpu).tokens_per_s
        rows.append((config.label(), predicted, result["tokens_per_s"]))
    fastest = max(rows, key=lambda row: row[2])
    print(
        f"{path.name}: {len(rows)} measured configs; this CPU now: fp32 matmul {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s; {skipped} bf16 configs left out"
    )
    print(f"{'config':<40} {'predicted':>10} {'measured':>10} {'ratio':>6} {'vs fastest':>10}")
    relative = []
    for label, predicted, measured in sorted(rows, key=lambda row: -row[2]):
        ratio = predicted / measured
        against = ratio / (fastest[1] / fastest[2])
        relative.append(against)
        print(f"{label:<40} {predicted:>10,.0f} {measured:>10,.0f} {ratio:>6.2f} {against:>10.2f}")
    ratios = [p / m for _, p, m in rows]
    print(
        f"predicted / measured: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
        f"relative to the fastest config: median |error| {statistics.median(abs(r - 1) for r in relative):.0%}, "
        f"worst x{max(max(r, 1 / r) for r in relative):.2f}"
    )
    predicted_order = [label for label, *_ in sorted(rows, key=lambda row: -row[1])]
    measured_order = [label for label, *_ in sorted(rows, key=lambda row: -row[2])]
    print(f"fastest predicted: {predicted_order[0]}; fastest measured: {measured_order[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
