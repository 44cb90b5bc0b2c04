"""Do repeated searches agree? The same space searched N times (default 3), each from an empty
database and an empty estimate cache, as a user runs it (`autotune search`, confirmation round
on). Two picks agree when they are the same config, or when a run that saw both declared them
tied: its confirmation round named the other tied, or measured it within the noise it judged by
(that run could not tell them apart).

    python -m benchmarks.agreement [--repeats 3] [--out FILE.json]

The space is the tiny GPT-2 of benchmarks/probe_overhead.py on CPU: 40 candidates, a budget that
makes some run out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.probe_overhead import REPO, TINY_SPACE, write_tiny_model

SPACE = TINY_SPACE  # confirmation round on, as users search


def search_once(model: Path, work: Path) -> dict:
    work.mkdir(parents=True)
    env = {**os.environ, "AUTOTUNE_HOME": str(work)}
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
            f"sqlite:///{work / 'autotune.db'}",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the search failed ({done.returncode}): {done.stderr[-2000:]}")
    outcome = json.loads(done.stdout)
    confirmation = outcome.get("confirmation") or {}
    best = outcome["best"]["tokens_per_s"]
    within = confirmation.get("noise") or 0.0
    indistinct = [
        row["label"]
        for row in outcome["leaderboard"]
        if row["tokens_per_s"]
        and row["tokens_per_s"] * (1 + within) >= best
        and row["label"] != outcome["best"]["label"]
    ]
    return {
        "pick": outcome["best"]["label"],
        "tokens_per_s": round(best),
        "tied_with": confirmation.get("tied") or [],
        "within_noise": indistinct,
        "confirmed": confirmation.get("confirmed"),
        "margin": confirmation.get("margin"),
        "noise": confirmation.get("noise"),
        "runner_up": confirmation.get("runner_up"),
        "probed": outcome["probed"],
        "confirmation_probes": confirmation.get("probes"),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def agree(runs: list[dict]) -> bool:
    """Every two picks are the same, or one of the two runs found them tied."""

    def tied(a: dict, b: dict) -> bool:
        return b["pick"] in a["tied_with"] + a["within_noise"]

    return all(a["pick"] == b["pick"] or tied(a, b) or tied(b, a) for a in runs for b in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp, "tiny-gpt2"))
        for i in range(args.repeats):
            run = search_once(model, Path(tmp, f"run-{i}"))
            runs.append(run)
            how = (
                "tied with " + ", ".join(run["tied_with"])
                if run["tied_with"]
                else f"confirmed by {run['margin']:.0%} over {run['runner_up']}"
                if run["confirmed"]
                else "unconfirmed"
            )
            if run["within_noise"]:
                how += f"; within its noise ({run['noise']:.0%}): " + ", ".join(run["within_noise"])
            print(
                f"run {i + 1}: {run['pick']} at {run['tokens_per_s']:,} tokens/s ({how}); {run['probed']} probes "
                f"+ {run['confirmation_probes']} to confirm, {run['wall_s']} s",
                flush=True,
            )
    verdict = agree(runs)
    print(f"the {args.repeats} picks {'agree' if verdict else 'DISAGREE'}")
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "space": SPACE,
                    "runs": runs,
                    "agree": verdict,
                },
                indent=2,
            )
            + "\n"
        )
    sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
