"""The spread between processes (pass 2): the search's pick probed in fresh processes one after
another, their tokens/s and spread against the noise the search judged its pick by. Its probes go into
the truth's file (tagged `spread`), through the same child (fresh_probes).
"""

from __future__ import annotations

from benchmarks.gpu_evidence.common import KILL_GRACE_SECONDS, WRAP_UP_SECONDS, Failed, Pending
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.truth import TRUTH_FILE, median_of, read_rows, spread_of, study_candidates

SPREAD_PROCESSES = 5
# On CPU the section checks its machinery, not a card's spread: two processes show it (each one is a
# fresh process's seconds of imports).
CPU_SPREAD_PROCESSES = 2


def section_spread(run: Run) -> dict:
    """The pick in SPREAD_PROCESSES fresh processes (CPU_SPREAD_PROCESSES on CPU), one after another:
    the spread between them, against the noise the search judged its pick by."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    pick = (readme.get("pick") or {}).get("label")
    candidates = study_candidates(run, db, study)
    key = next((c["key"] for c in candidates["measured"] if c["label"] == pick), None)
    if key is None:
        raise Failed(f"the pick {pick!r} is not among the study's configs")
    path = run.state / TRUTH_FILE
    wanted = SPREAD_PROCESSES if run.cuda else CPU_SPREAD_PROCESSES
    left = wanted - len(read_rows(path, "spread"))
    if left > 0:
        seconds = 1e9 if run.deadline.left() is None else run.deadline.left() - WRAP_UP_SECONDS
        run.helper(
            "fresh_probes",
            timeout=seconds + KILL_GRACE_SECONDS + 60,
            db=db,
            study=study,
            keys=[key] * left,
            results=str(path),
            seconds=seconds,
            tag="spread",
        )
    rows = read_rows(path, "spread")
    samples = [r["tokens_per_s"] for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    confirmation = candidates["confirmation"] or {}
    figures = {
        "config": pick,
        "processes": len(rows),
        "statuses": [r["status"] for r in rows],
        "tokens_per_s": [round(s, 1) for s in samples],
        "median": median_of(samples),
        "min": min(samples, default=None),
        "max": max(samples, default=None),
        "spread": spread_of(samples),
        "step_spreads": [r.get("step_spread") for r in rows],
        "search_tokens_per_s": (readme.get("pick") or {}).get("tokens_per_s"),
        "search_noise": confirmation.get("noise"),
        "search_confirmation": confirmation,
        "startup_seconds": [r.get("startup_seconds") for r in rows],
    }
    if len(rows) < wanted:
        raise Pending(f"{wanted - len(rows)} processes left", figures)
    return figures
