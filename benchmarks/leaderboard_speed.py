"""How long `autotune leaderboard` takes over a database of 10,000 probes (target: under 0.5 s).

Fills a temporary SQLite database with one study of N probes (a realistic mix: most ok, some oom,
skipped and timeouts, over a few hundred distinct configs), then runs the real CLI in a subprocess,
as a user would, several times. Side by side, in the same run: a bare interpreter start and
`autotune --help`, so the figure can be read as start-up cost plus query cost on this machine.

An installed autotune has its bytecode compiled (pip does it); a source checkout run with
PYTHONDONTWRITEBYTECODE=1 recompiles every autotune module on every start (about 40 ms here). The
headline figure uses a bytecode cache in a temporary directory (PYTHONPYCACHEPREFIX), as installed;
the figure without one is printed beside it.

    python benchmarks/leaderboard_speed.py [--probes 10000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path


def fill(db_path: Path, probes: int) -> None:
    from sqlalchemy import insert

    from autotune.levers.config import ProbeConfig
    from autotune.host.environment import Environment
    from autotune.specs.models import resolve_model
    from autotune.store import open_store
    from autotune.store.schema import Probe

    env = Environment("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, cuda_version="12.8", torch_version="2.13")
    spec = resolve_model("gpt2")
    with open_store(str(db_path)) as store:
        study = store.get_or_create_study(
            "bench",
            model=spec,
            environment=env,
            budget_bytes=8 * 2**30,
            margin_bytes=2**28,
            effective_batch=64,
            space={"micro_batch": [1, 2, 4, 8, 16, 32, 64]},
        )
        grid = list(
            itertools.product(
                (1, 2, 4, 8, 16, 32, 64),
                (128, 256, 512, 1024),
                ("fp32", "fp16", "bf16"),
                (False, True),
                ("sdpa", "eager"),
            )
        )
        statuses = ["ok"] * 7 + ["oom", "skipped", "timeout"]
        now = datetime.now(timezone.utc)
        rows = []
        for i in range(probes):
            mb, block, precision, ckpt, attention = grid[i % len(grid)]
            config = ProbeConfig(
                "gpt2", mb, block, grad_accum=64 // mb, precision=precision, checkpointing=ckpt, attention=attention
            )
            status = statuses[(i * 7) % len(statuses)]
            ok = status == "ok"
            rows.append(
                {
                    "study_id": study.id,
                    "trial_number": i,
                    "config_key": config.key(),
                    **config.to_dict(),
                    "status": status,
                    "device": env.device_name,
                    "budget_bytes": 8 * 2**30,
                    "margin_bytes": 2**28,
                    "peak_allocated_bytes": mb * block * 2**17,
                    "peak_reserved_bytes": mb * block * 2**17 + 2**27,
                    "step_seconds": 1.0 / mb if ok else None,
                    "tokens_per_s": 1000.0 * mb * block / (1 + i % 13) if ok else None,
                    "samples_per_s": float(mb) if ok else None,
                    "wall_seconds": 9.0,
                    "cacheable": status != "timeout",
                    "started_at": now - timedelta(seconds=10),
                    "finished_at": now,
                    "env_fingerprint": env.fingerprint(),
                }
            )
        with store.engine.begin() as connection:
            connection.execute(insert(Probe), rows)


def timed(argv: list[str], env: dict[str, str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "bench.db"
        started = time.perf_counter()
        fill(db, args.probes)
        fill_seconds = time.perf_counter() - started
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env = {
            **base,
            "AUTOTUNE_HOME": scratch,
            "AUTOTUNE_DB": str(db),
            "PYTHONPYCACHEPREFIX": str(Path(scratch) / "pyc"),
        }
        no_pyc = {**env, "PYTHONDONTWRITEBYTECODE": "1"}
        python = [sys.executable]
        command = [*python, "-m", "autotune", "leaderboard", "--db", str(db)]
        timed(command, env, 1)  # warm-up: fills the bytecode cache and the OS file cache
        leaderboard = timed(command, env, args.repeat)
        uncompiled = timed(command, no_pyc, args.repeat)
        top10 = timed([*command, "--top", "10"], env, args.repeat)
        helptext = timed([*python, "-m", "autotune", "--help"], env, args.repeat)
        bare = timed([*python, "-c", "pass"], env, args.repeat)
    med = statistics.median
    print(
        f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"filled {args.probes} probes in {fill_seconds:.1f} s"
    )
    print(
        f"autotune leaderboard over {args.probes} probes: median {med(leaderboard):.3f} s "
        f"(min {min(leaderboard):.3f}), --top 10 {med(top10):.3f} s, without bytecode cache {med(uncompiled):.3f} s; "
        f"autotune --help {med(helptext):.3f} s; bare python {med(bare):.3f} s; "
        f"leaderboard / --help = {med(leaderboard) / med(helptext):.1f}x; target < 0.5 s: "
        f"{'met' if med(leaderboard) < 0.5 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
