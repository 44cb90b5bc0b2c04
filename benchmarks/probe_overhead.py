"""Probe overhead, before and after: the same search run by an earlier autotune (a git ref of this
repository) and by this checkout, side by side in one run, each from an empty database and an
empty estimate cache.

Overhead per probe = (the command's wall time - the sum of the probes' timed windows) / probes
run: everything a user waits for that is not measurement (process start, imports, model builds,
warm-up steps, memory predictions, restarts after OOMs, the database).

    python -m benchmarks.probe_overhead [--baseline REF] [--repeats N] [--out FILE.json]

The default space is a tiny GPT-2 on CPU whose budget makes some configs run out of memory (as
budgets do): 40 candidates, 17-18 probes by the frontier search.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The last commit before the overhead work of issue 17 (a probe child restarted after every OOM,
# predictions traced in one process after the probe child's start-up, before the first probe).
BASELINE = "2d23d11"
TINY = {
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
# The space of the tiny GPT-2 (40 candidates; the budget makes some run out of memory), shared with
# benchmarks/agreement.py. Overhead is timed without the confirmation round (the same for both).
TINY_SPACE = [
    "--gpu-budget",
    "34MiB",
    "--device",
    "cpu",
    "--micro-batches",
    "1,2,4,8,16",
    "--block-sizes",
    "128",
    "--effective-batch",
    "16",
    "--precisions",
    "fp32,bf16",
    "--checkpointing",
    "off,on",
    "--attention",
    "sdpa,eager",
]
SPACE = [*TINY_SPACE, "--no-confirm"]


def write_tiny_model(folder: Path) -> Path:
    """A directory with the tiny GPT-2's config.json (no weights: probes build from config)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def export_tree(ref: str, into: Path) -> Path:
    """The files of `ref` (git archive), to run that autotune from."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    # Before 2026-12-01 the migrations were a top-level folder, installed under autotune.store by
    # pyproject's package-dir: an exported tree of then must find its own where autotune looks now.
    inside = into / "autotune" / "store" / "migrations"
    if (into / "migrations").is_dir() and not inside.exists():
        inside.symlink_to(into / "migrations", target_is_directory=True)
    return into


def run_search(tree: Path, model: Path, work: Path) -> dict:
    """One search by the autotune in `tree`, from nothing: its wall time and its probes' windows."""
    work.mkdir(parents=True)
    db = work / "autotune.db"
    env = {**os.environ, "AUTOTUNE_HOME": str(work), "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "search",
            "--model",
            str(model),
            *SPACE,
            "--db",
            f"sqlite:///{db}",
            "--json",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the search in {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    outcome = json.loads(done.stdout)
    with sqlite3.connect(db) as connection:
        statuses = [
            row[0] for row in connection.execute("select status from autotune_probes where status != 'skipped'")
        ]
        windows = connection.execute("select coalesce(sum(measured_seconds), 0) from autotune_probes").fetchone()[0]
    probes = outcome["probed"]
    return {
        "wall_s": round(wall, 2),
        "probes": probes,
        "ooms": statuses.count("oom"),
        "windows_s": round(windows, 2),
        "overhead_per_probe_s": round((wall - windows) / probes, 3),
        "search_s": round(outcome["seconds"], 2),
        "best": outcome["best"]["label"] if outcome.get("best") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", default=BASELINE, help=f"git ref of the autotune to compare with [default: {BASELINE}]"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, alternating [default: 1]")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp, "tiny-gpt2"))
        trees = {
            f"before ({args.baseline})": export_tree(args.baseline, Path(tmp, "before")),
            "after (this checkout)": REPO,
        }
        for repeat in range(args.repeats):
            for name, tree in trees.items():
                row = {"version": name, "repeat": repeat + 1, **run_search(tree, model, Path(tmp, f"run-{len(rows)}"))}
                rows.append(row)
                print(
                    f"{name:>24} #{row['repeat']}: {row['wall_s']:6.2f} s wall, {row['probes']} probes "
                    f"({row['ooms']} OOM), windows {row['windows_s']:.2f} s -> {row['overhead_per_probe_s']:.3f} s "
                    f"overhead a probe; picked {row['best']}",
                    flush=True,
                )
    by_version = {name: [r["overhead_per_probe_s"] for r in rows if r["version"] == name] for name in trees}
    before, after = (min(values) for values in by_version.values())
    print(
        f"overhead a probe, best of {args.repeats}: {before:.3f} s before, {after:.3f} s after: {before / after:.2f}x lower"
    )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "space": SPACE,
                    "rows": rows,
                    "ratio": round(before / after, 2),
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
