"""Wall time of one search with 1 and with 2 workers (`autotune search --workers N`), and with 2
workers started by each launcher (`--launchers local,ray`): wall time and probes per worker side by
side. `--start-ray` starts a throwaway two-node Ray cluster on loopback (one CPU each) for the ray
runs, and stops it after; or give `--ray-address` of a running one.

Real probes of a tiny GPT-2 (2 layers, 64 wide) on the CPU: 8 candidates (micro-batches 1-8,
block 64, fp32, checkpointing off/on, SDPA) against a 16 MiB budget, one measured step per probe.
Each run starts from an empty SQLite file, so nothing is reused; runs alternate (1, 2, 1, 2, ...)
so that a change in the machine's load hits both. On a machine with few cores the workers compete
for them: the figure says what parallel workers buy where probes are short and start-up (the
interpreter, torch, the model) dominates, not what they buy on a node with one GPU per worker.

    python -m benchmarks.workers_speed [--repeats 2] [--launchers local,ray --start-ray]
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
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "vocab_size": 1024,
    "n_positions": 256,
    "n_ctx": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
FLAGS = [
    "--gpu-budget",
    "16MiB",
    "--device",
    "cpu",
    "--micro-batches",
    "1,2,4,8",
    "--block-sizes",
    "64",
    "--effective-batch",
    "8",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off,on",
    "--attention",
    "sdpa",
    "--measure-steps",
    "1",
    "--no-predict",
    "--json",
]


def run(
    model: Path, workers: int, scratch: Path, index: int, launcher: str = "local", ray_address: str | None = None
) -> dict:
    db = scratch / f"run{index}-w{workers}-{launcher}.db"
    started = time.perf_counter()
    extra = ["--launcher", launcher] + (["--ray-address", ray_address] if ray_address else [])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "search",
            "--model",
            str(model),
            *FLAGS,
            "--study",
            f"speed{index}",
            "--workers",
            str(workers),
            "--db",
            str(db),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "AUTOTUNE_HOME": str(scratch / "home")},
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"search with {workers} worker(s) failed:\n{done.stderr}")
    summary = json.loads(done.stdout)
    return {
        "workers": workers,
        "launcher": launcher,
        "wall_s": wall,
        "probed": summary["probed"],
        "skipped": summary["skipped"],
        "best": summary["best"]["label"] if summary["best"] else None,
        "per_worker": probes_per_worker(db, f"speed{index}"),
    }


def probes_per_worker(db: Path, study: str) -> list[int]:
    """How many probes each worker ran (skips are not probes), most first."""
    from collections import Counter

    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        counts = Counter(p.worker for p in store.probes(study) if p.result.status != "skipped")
    return sorted(counts.values(), reverse=True)


def ray_cluster(scratch: Path) -> tuple[str, list[str]]:
    """A throwaway two-node Ray cluster on loopback: its address, and the command that stops it."""
    import socket

    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    subprocess.run(
        [*ray, "start", "--head", "--port", str(port), "--include-dashboard=false", *common],
        check=True,
        capture_output=True,
        env=env,
        timeout=180,
    )
    subprocess.run(
        [*ray, "start", "--address", f"127.0.0.1:{port}", *common],
        check=True,
        capture_output=True,
        env=env,
        timeout=180,
    )
    return f"127.0.0.1:{port}", [*ray, "stop", "--force"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each worker count")
    parser.add_argument("--launchers", default="local", help="launchers to compare with 2 workers: local,ray")
    parser.add_argument("--ray-address", default=None, help="a running Ray cluster for the ray runs")
    parser.add_argument("--start-ray", action="store_true", help="start a two-node Ray cluster here for the ray runs")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    stop_ray: list[str] | None = None
    with tempfile.TemporaryDirectory(prefix="autotune-workers-speed-") as tmp:
        scratch = Path(tmp)
        model = scratch / "tiny-gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_GPT2))
        address = args.ray_address
        if "ray" in launchers and args.start_ray:
            address, stop_ray = ray_cluster(scratch)
        try:
            rows = [run(model, workers, scratch, i) for i in range(args.repeats) for workers in (1, 2)]
            rows += [
                run(model, 2, scratch, i, launcher, address)
                for i in range(args.repeats)
                for launcher in launchers
                if launcher != "local"
            ]
        finally:
            if stop_ray is not None:
                subprocess.run(stop_ray, capture_output=True, timeout=120)
    for row in rows:
        print(
            f"{row['launcher']:<6} workers {row['workers']}  wall {row['wall_s']:6.1f} s  probes {row['probed']} "
            f"(per worker {row['per_worker']})  skipped {row['skipped']}  best {row['best']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    one = statistics.median(r["wall_s"] for r in rows if r["workers"] == 1)
    two = statistics.median(r["wall_s"] for r in rows if r["workers"] == 2 and r["launcher"] == "local")
    for launcher in launchers:
        if launcher != "local":
            other = statistics.median(r["wall_s"] for r in rows if r["launcher"] == launcher)
            print(f"median wall with 2 workers: local {two:.1f} s, {launcher} {other:.1f} s ({other / two:.2f}x local)")
    print(
        f"median wall: 1 worker {one:.1f} s, 2 workers {two:.1f} s: {one / two:.2f}x "
        f"({os.cpu_count()} CPU cores, shared; {args.repeats} run(s) each)"
    )


if __name__ == "__main__":
    main()
