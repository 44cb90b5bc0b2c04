"""benchmarks.run's grid (pass 3) with a state of its own, resumed across commands (its exit 3: it went
as far as the deadline let it), summarised per case: the search's pick and cost against the ground
truth's, and the alternatives'.
"""

from __future__ import annotations

import json
import shlex

from benchmarks.gpu_evidence.common import Failed, Pending, last_line
from benchmarks.gpu_evidence.invocation import Run


def benchmark_args(run: Run) -> list[str]:
    if run.cuda:
        return ["--models", "gpt2"]
    # benchmarks.run's tiny case, cut to two configs and the two phases that give its figures.
    return [
        "--device",
        "cpu",
        "--models",
        "tiny:12MiB",
        "--micro-batches",
        "1,2",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--effective-batch",
        "2",
        "--phases",
        "ground-truth,search",
        "--no-estimate",
    ]


def benchmark_summary(doc: dict) -> dict:
    cases = []
    for case in doc.get("cases", []):
        search, truth = case.get("autotune") or {}, case.get("ground_truth") or {}
        cases.append(
            {
                "model": case.get("model"),
                "budget_bytes": case.get("budget_bytes"),
                "candidates": case.get("candidates"),
                "figures": case.get("figures"),
                "pending": case.get("pending"),
                "search_pick": (search.get("pick") or {}).get("label"),
                "search_probes": search.get("probed"),
                "search_gpu_seconds": search.get("gpu_seconds"),
                "ground_truth_probes": truth.get("probed"),
                "ground_truth_gpu_seconds": truth.get("gpu_seconds"),
                "alternatives": [
                    {k: a.get(k) for k in ("name", "status", "probed")} | {"pick": (a.get("pick") or {}).get("label")}
                    for a in case.get("alternatives") or []
                ],
            }
        )
    return {"device": doc.get("device"), "date": doc.get("date"), "complete": doc.get("complete"), "cases": cases}


def section_benchmark(run: Run) -> dict:
    """benchmarks.run with its own state: exit 3 means it went as far as the deadline let it."""
    out = run.state / "bench-out"
    argv = [
        run.python,
        "-m",
        "benchmarks.run",
        *benchmark_args(run),
        "--state",
        str(run.state / "bench"),
        "--out",
        str(out),
        "--brief",
        *run.timeout_flag("--deadline"),
    ]
    earlier = run.previous("benchmark")
    outcome = run.command(argv)
    attempts = {
        "attempts": earlier.get("attempts", 0) + 1,
        "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
        "command": "python -m benchmarks.run " + shlex.join(argv[3:]),
    }
    if outcome.cut or outcome.returncode == 3:
        raise Pending("benchmarks.run has phases left; the same command goes on", attempts)
    if outcome.returncode != 0:
        raise Failed(f"benchmarks.run: exit status {outcome.returncode}: {last_line(outcome.stdout)}", attempts)
    written = sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not written:
        raise Failed(f"benchmarks.run wrote no JSON into {out}", attempts)
    return {
        **attempts,
        "json": str(written[-1].relative_to(run.state)),
        **benchmark_summary(json.loads(written[-1].read_text())),
    }
