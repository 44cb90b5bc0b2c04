"""The README's command (pass 1 and 2): `autotune search` on gpt2 under 8 GiB from an empty database,
then `autotune best`; and run_search, the `autotune search --json` that resumes across commands from
its own database, which the other searching sections (eval_generation, data_lengths,
liger_allocator_search) are made of, with every probe the search stored read back in a child.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from benchmarks.gpu_evidence.children import Outcome
from benchmarks.gpu_evidence.common import Pending, one_line
from benchmarks.gpu_evidence.invocation import Run


def readme_search_args(run: Run) -> list[str]:
    """The README's command: gpt2 under 8 GiB; on CPU a tiny GPT-2 under 12 MiB, a two-config space,
    without the memory prediction (its trace child is 5 s of the CPU mode's minute; estimator_vs_probe
    runs the estimator anyway), and windows of 0.05 s (a few of the tiny model's steps: the CPU mode
    checks the machinery, not a speed, and the study's window is every later probe's too, about 15
    in pass 2's sections, confirmation included)."""
    if run.cuda:
        return ["--model", "gpt2", "--gpu-budget", "8GiB"]
    return [
        "--model",
        str(run.tiny_model),
        "--gpu-budget",
        "12MiB",
        "--device",
        "cpu",
        "--no-predict",
        "--micro-batches",
        "1,2",
        "--effective-batch",
        "2",
        "--block-sizes",
        "64",
        "--precisions",
        "fp32",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--measure-seconds",
        "0.05",
    ]


def search_figures(summary: dict, outcome: Outcome, earlier: dict) -> dict:
    """What a `search --json` said, its wall time added to the earlier attempts' (a search the
    deadline cut short resumes from its database)."""
    best = summary.get("best") or {}
    return {
        "exit_status": outcome.returncode,
        "study": summary.get("study"),
        "study_status": summary.get("status"),
        "stop_reason": summary.get("stop_reason"),
        "candidates": summary.get("candidates"),
        "probes": summary.get("probed"),
        "reused": summary.get("reused"),
        "skipped": summary.get("skipped"),
        "unmeasured": summary.get("unmeasured"),
        "confirmation": summary.get("confirmation"),
        "attempts": earlier.get("attempts", 0) + 1,
        "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
        "search_seconds": round(earlier.get("search_seconds", 0.0) + float(summary.get("seconds") or 0.0), 1),
        "pick": {
            key: best.get(key)
            for key in (
                "label",
                "tokens_per_s",
                "step_seconds",
                "peak_allocated_bytes",
                "peak_reserved_bytes",
                "context_bytes",
                "mfu",
                "phase_peaks",
                "eval_batch_found",
            )
        }
        if best
        else None,
        "leaderboard": [
            {key: row.get(key) for key in ("label", "tokens_per_s", "peak_reserved_bytes", "context_bytes")}
            for row in summary.get("leaderboard", [])
        ],
    }


def run_search(run: Run, earlier: dict, args: list[str], db: str) -> dict:
    """One `autotune search --json` that resumes across calls (`earlier`: what the last attempts
    recorded): Pending while the deadline cuts it."""
    # Said by the first attempt: a search resumed from its own database is still the one from empty.
    empty = earlier.get("database_was_empty", not Path(db.removeprefix("sqlite:///")).exists())
    argv = ["search", *args, "--db", db, "--json", *run.timeout_flag("--timeout", "s")]
    outcome = run.autotune(*argv)
    if outcome.cut:
        raise Pending(
            "the search was stopped at the deadline; the same command goes on",
            {
                **earlier,
                "database_was_empty": empty,
                "attempts": earlier.get("attempts", 0) + 1,
                "wall_seconds": round(earlier.get("wall_seconds", 0.0) + outcome.seconds, 1),
            },
        )
    summary = outcome.json(accept=(0, 1, 3), what="autotune search")
    figures = {
        "database_was_empty": empty,
        "command": "autotune " + shlex.join(argv),
        **search_figures(summary, outcome, earlier),
    }
    if summary.get("stop_reason") in ("timeout", "interrupted"):
        raise Pending("the search stopped at its --timeout; the same command goes on", figures)
    figures["probes_stored"] = run.helper("study_probes", timeout=120, db=db)["probes"]
    return figures


def section_readme_command(run: Run) -> dict:
    """The README's search from an empty database, then `autotune best --format json`."""
    db = run.db("readme.db")
    figures = run_search(run, run.previous("readme_command"), readme_search_args(run), db)
    best = run.autotune("best", "--db", db, "--format", "json", timeout=120)
    figures["best"] = best.json(what="autotune best") if best.returncode == 0 else {"exit_status": best.returncode}
    return figures


def helper_study_probes(db: str) -> dict:
    """Every probe stored in `db`, compact."""
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        records = store.probes()
    return {
        "probes": [
            {
                "label": r.config.label(),
                "config": r.config.to_dict(),
                "status": str(r.result.status),
                "tokens_per_s": r.result.tokens_per_s,
                "peak_allocated_bytes": r.result.peak_allocated_bytes,
                "peak_reserved_bytes": r.result.peak_reserved_bytes,
                "context_bytes": r.result.context_bytes,
                "wall_seconds": r.result.wall_seconds,
                "build_seconds": r.result.build_seconds,
                "measured_seconds": r.result.measured_seconds,
                "error": one_line(r.result.error or "") or None,
            }
            for r in records
        ]
    }
