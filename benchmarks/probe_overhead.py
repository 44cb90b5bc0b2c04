"""Probe overhead: a warm child process reused across clean probes vs a fresh process per probe.

Runs the same sequence of probes both ways and reports, per mode, the wall time of the whole
sequence and how much of it was the measured training window.

    python -m benchmarks.probe_overhead [--model gpt2] [--device cpu] [--probes 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.probe import ProbeRunner, ProbeSettings

TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1024, "n_positions": 256}


def run(model: str, device: str, probes: int, reuse: bool) -> dict:
    configs = [ProbeConfig(model=model, micro_batch=mb, block_size=128) for mb in (1, 2, 4, 8)][:probes]
    settings = ProbeSettings(device=device, measure_steps=2)
    started = time.perf_counter()
    with ProbeRunner(settings, reuse_child=reuse) as runner:
        results = [runner.run(c, 2**34 if device != "cpu" else 8 * 2**30) for c in configs]
    wall = time.perf_counter() - started
    return {
        "mode": "warm child" if reuse else "process per probe",
        "probes": len(results),
        "statuses": [r.status for r in results],
        "wall_s": round(wall, 2),
        "startup_s": round(sum(r.startup_seconds or 0 for r in results), 2),
        "build_s": round(sum(r.build_seconds or 0 for r in results), 2),
        "measured_s": round(sum(r.measured_seconds or 0 for r in results), 2),
        "device": results[0].device,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: a tiny 2-layer GPT-2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--probes", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            Path(tmp, "config.json").write_text(json.dumps(TINY))
            model = tmp
        rows = [run(model, args.device, args.probes, reuse) for reuse in (False, True)]
    for row in rows:
        share = row["measured_s"] / row["wall_s"]
        print(f"{row['mode']:>18}: {row['probes']} probes in {row['wall_s']:.2f} s wall "
              f"(start-up {row['startup_s']:.2f} s, build {row['build_s']:.2f} s, measured {row['measured_s']:.2f} s = {share:.0%}) on {row['device']}")
    print(f"warm child speed-up on the whole sequence: {rows[0]['wall_s'] / rows[1]['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
