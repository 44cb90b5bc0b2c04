"""`make demo` on a busy machine: does a second run finish what a first one cut short?

Starts BUSY processes that spin on the CPU (a shared workstation, a node other jobs run on), then
runs the CPU demo's search (the Makefile's CPU_DEMO_ARGS: --timeout 5m) twice on one fresh
database, and prints each run's footer and verdict: the first may be cut by its deadline (the
confirmation round included: its windows are kept as they are measured), the second must finish
("every candidate settled") with a confirmed or declared-tie pick, reusing the first run's windows
(counted in its footer). The busy processes die with this one.

    python -m benchmarks.demo_under_load                      # 4 busy processes, two runs (10 minutes at most)
    python -m benchmarks.demo_under_load --busy 4 --out docs/results/demo-under-load.txt
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_layer": 6,
    "n_embd": 384,
    "n_head": 6,
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_ctx": 1024,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}


def demo_arguments(model: Path) -> list[str]:
    """The Makefile's CPU_DEMO_ARGS (read from it, so that this measures what `make demo` runs)."""
    for line in (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines():
        if line.startswith("CPU_DEMO_ARGS"):
            text = line.split(":=", 1)[1].replace("$(DEMO_MODEL)", str(model))
            return shlex.split(text)
    raise SystemExit("no CPU_DEMO_ARGS in the Makefile")


def spin() -> None:
    while True:
        pass


def run(args: list[str], env: dict[str, str]) -> tuple[str, str, float, int]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "search", *args, "--json"], capture_output=True, text=True, env=env
    )
    return proc.stdout, proc.stderr, time.perf_counter() - started, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=4, help="CPU-bound processes beside the demo [default: 4]")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the summary to this file")
    parser.add_argument("--log", default=None, help="also write each run's progress (stderr) to this file")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "demo-gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(DEMO_CONFIG))
        env = {**os.environ, "AUTOTUNE_DB": f"sqlite:///{tmp}/demo.db", "AUTOTUNE_HOME": tmp}
        busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(options.busy)]
        for process in busy:
            process.start()
        lines = [
            f"{options.busy} busy processes on {os.cpu_count()} cores; the demo's search "
            f"({' '.join(demo_arguments(Path('.venv/demo-gpt2')))}) run {options.runs} times on one database"
        ]
        try:
            for number in range(1, options.runs + 1):
                out, progress, seconds, code = run(demo_arguments(model), env)
                if options.log:
                    with open(options.log, "a") as log:
                        log.write(f"--- run {number}\n{progress}\n")
                summary = json.loads(out) if out.strip().startswith("{") else {}
                decision = summary.get("confirmation") or {}
                lines.append(
                    f"run {number}: exit {code}, {seconds:.0f} s, stop {summary.get('stop_reason')}, probes "
                    f"{summary.get('probed')} + {summary.get('confirming_probes')} in the round, windows reused "
                    f"{summary.get('reused_windows')}, reused probes {summary.get('reused')}; pick "
                    f"{(summary.get('best') or {}).get('label')}; decision: "
                    + (
                        "round unfinished"
                        if decision.get("partial")
                        else "tie"
                        if decision.get("tied")
                        else "confirmed"
                        if decision.get("confirmed")
                        else "none"
                        if not decision
                        else "unconfirmed"
                    )
                    + (", not reliable" if decision and decision.get("reliable") is False else "")
                )
                print(lines[-1], flush=True)
        finally:
            for process in busy:
                process.terminate()
    if options.out:
        Path(options.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
