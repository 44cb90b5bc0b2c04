"""Wall time of one search with 1 and with 2 workers (`autotune search --workers N`).

Real probes of a tiny GPT-2 (2 layers, 64 wide) on the CPU: 8 candidates (micro-batches 1-8,
block 64, fp32, checkpointing off/on, SDPA) against a 16 MiB budget, one measured step per probe.
Each run starts from an empty SQLite file, so nothing is reused; runs alternate (1, 2, 1, 2, ...)
so that a change in the machine's load hits both. On a machine with few cores the workers compete
for them: the figure says what parallel workers buy where probes are short and start-up (the
interpreter, torch, the model) dominates, not what they buy on a node with one GPU per worker.

    python -m benchmarks.workers_speed [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY_GPT2 = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2,
    "vocab_size": 1024, "n_positions": 256, "n_ctx": 256, "bos_token_id": 0, "eos_token_id": 0,
}
FLAGS = ["--gpu-budget", "16MiB", "--device", "cpu", "--micro-batches", "1,2,4,8", "--block-sizes", "64",
         "--effective-batch", "8", "--precisions", "fp32", "--checkpointing", "off,on", "--attention", "sdpa",
         "--measure-steps", "1", "--no-predict", "--json"]


def run(model: Path, workers: int, scratch: Path, index: int) -> dict:
    db = scratch / f"run{index}-w{workers}.db"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autotune", "search", "--model", str(model), *FLAGS,
                           "--study", f"speed{index}", "--workers", str(workers), "--db", str(db)],
                          capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "AUTOTUNE_HOME": str(scratch / "home")})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"search with {workers} worker(s) failed:\n{done.stderr}")
    summary = json.loads(done.stdout)
    return {"workers": workers, "wall_s": wall, "probed": summary["probed"], "skipped": summary["skipped"],
            "best": summary["best"]["label"] if summary["best"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each worker count")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autotune-workers-speed-") as tmp:
        scratch = Path(tmp)
        model = scratch / "tiny-gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_GPT2))
        rows = [run(model, workers, scratch, i) for i in range(args.repeats) for workers in (1, 2)]
    for row in rows:
        print(f"workers {row['workers']}  wall {row['wall_s']:6.1f} s  probes {row['probed']}  "
              f"skipped {row['skipped']}  best {row['best']}")
    one = statistics.median(r["wall_s"] for r in rows if r["workers"] == 1)
    two = statistics.median(r["wall_s"] for r in rows if r["workers"] == 2)
    print(f"median wall: 1 worker {one:.1f} s, 2 workers {two:.1f} s: {one / two:.2f}x "
          f"({os.cpu_count()} CPU cores, shared; {args.repeats} run(s) each)")


if __name__ == "__main__":
    main()
