"""Pass 2's first question, is the search's pick the fastest on the card: the ground truth that the
noise between processes cannot fool. Every config of the README's search that its memory predictions
do not rule out, probed in fresh processes (round 1 in the space's order, round 2 in reverse, the
contenders first, so that whatever the deadline cuts, the contenders measured have their second
process); each config's median and spread; the search's pick held against the truth's best, beside
the goals the issue sets. The probing runs in a child (fresh_probes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.gpu_evidence.common import KILL_GRACE_SECONDS, WRAP_UP_SECONDS, Failed, Pending, SectionEnd
from benchmarks.gpu_evidence.invocation import Run

TRUTH_FILE = "truth.jsonl"  # every probe of the truth and of the spread, one JSON line each
# A config whose first process measured under this share of the best's cannot be the best within the
# noise between processes seen on a card (±25% on the H100, 2026-11-26: 0.75 / 1.25 = 0.6): its
# second process comes after the contenders'.
CONTENDER_SHARE = 0.6
# What the truth leaves, on a card, for the pass's sections after it that say more (train 200 steps,
# the plain Trainer, the pick in fresh processes); eval_generation gets what is left after those.
TRUTH_RESERVE_SECONDS = 170.0
# Round 1's share of the truth's time before round 2 starts on what it measured (all of it, when
# round 1 ends sooner).
ROUND_ONE_SHARE = 0.65
# Goals the issue sets (reported met or not); the run's against its probe's is run_speed's.
PICK_QUALITY_GOAL, PROBES_GOAL, GPU_SECONDS_GOAL = 0.98, 8, 0.15


def read_rows(path: Path, prefix: str) -> list[dict]:
    """The probes `path` holds whose tag starts with `prefix` (a line cut short by a kill is left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if str(row.get("tag", "")).startswith(prefix):
            rows.append(row)
    return rows


def next_truth_round(
    keys: Sequence[str], rows: Sequence[dict], first_round_closed: bool = False
) -> tuple[str, list[str]]:
    """The truth's next round and what it has left to measure: round 1 every config in `keys`' order;
    round 2 in reverse order (so that a drift of the card over the minutes weighs on both ends
    alike), the contenders of round 1 first, configs that did not fit in round 1 left out. Once
    round 1 has had its share of the time (`first_round_closed`), round 2 takes the configs round 1
    measured so far, then round 1 goes on, and so on: whatever the deadline cuts, the contenders
    measured have their second process."""
    first = {r["key"]: r for r in rows if r["tag"] == "truth-1"}
    first_todo = [k for k in keys if k not in first]
    if first_todo and not first_round_closed:
        return "1", first_todo
    second = {r["key"] for r in rows if r["tag"] == "truth-2"}
    fits = {
        k: first[k]["tokens_per_s"]
        for k in keys
        if k in first and first[k]["status"] == "ok" and first[k].get("tokens_per_s")
    }
    best = max(fits.values(), default=0.0)
    contenders = [k for k in reversed(keys) if k in fits and fits[k] >= CONTENDER_SHARE * best]
    others = [k for k in reversed(keys) if k in fits and k not in contenders]
    second_todo = [k for k in contenders + others if k not in second]
    if second_todo or not first_todo:
        return "2", second_todo
    return "1", first_todo


def spread_of(samples: Sequence[float]) -> float | None:
    """The largest over the smallest of a config's figures from separate processes, less one."""
    return round(max(samples) / min(samples) - 1, 4) if len(samples) >= 2 and min(samples) > 0 else None


def median_of(samples: Sequence[float]) -> float | None:
    ordered = sorted(samples)
    n = len(ordered)
    if not n:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def truth_table(keys: Sequence[str], labels: Mapping[str, str], rows: Sequence[dict]) -> list[dict]:
    """Per config: each process's tokens/s, their median and spread, sorted fastest first (configs
    that never fitted last)."""
    table = []
    for key in keys:
        mine = [r for r in rows if r["key"] == key]
        samples = [r["tokens_per_s"] for r in mine if r["status"] == "ok" and r.get("tokens_per_s")]
        table.append(
            {
                "label": labels[key],
                "key": key,
                "statuses": [r["status"] for r in mine],
                "tokens_per_s": [round(s, 1) for s in samples],
                "median": median_of(samples),
                "spread": spread_of(samples),
            }
        )
    return sorted(table, key=lambda row: -(row["median"] or 0.0))


def truth_verdict(table: Sequence[dict], readme: Mapping[str, Any], rows: Sequence[dict]) -> dict:
    """The search's pick against the truth: its quality, probes and GPU-seconds, each goal beside it."""
    measured = [row for row in table if row["median"]]
    if not measured:
        return {"pick_quality": None}
    best = measured[0]
    pick_label = (readme.get("pick") or {}).get("label")
    pick = next((row for row in measured if row["label"] == pick_label), None)
    first_only = max(
        (r for r in rows if r["tag"] == "truth-1" and r["status"] == "ok" and r.get("tokens_per_s")),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    truth_seconds = sum(r.get("wall_seconds") or 0.0 for r in rows)
    round_one_seconds = sum(r.get("wall_seconds") or 0.0 for r in rows if r["tag"] == "truth-1")
    search_seconds = readme.get("search_seconds") or 0.0
    quality = round(pick["median"] / best["median"], 4) if pick else None
    spreads = [row["spread"] for row in measured if row["spread"] is not None]
    return {
        "best": {"label": best["label"], "median": best["median"], "tokens_per_s": best["tokens_per_s"]},
        "pick": {
            "label": pick_label,
            "search_tokens_per_s": (readme.get("pick") or {}).get("tokens_per_s"),
            "truth_median": pick["median"] if pick else None,
            "truth_tokens_per_s": pick["tokens_per_s"] if pick else None,
        },
        "pick_quality": quality,
        "pick_quality_goal": PICK_QUALITY_GOAL,
        "pick_quality_met": quality is not None and quality >= PICK_QUALITY_GOAL,
        "pick_is_truth_best": pick_label == best["label"],
        "search_probes": readme.get("probes"),
        "probes_goal": PROBES_GOAL,
        "probes_met": readme.get("probes") is not None and readme["probes"] <= PROBES_GOAL,
        "truth_probes": len(rows),
        "truth_gpu_seconds": round(truth_seconds, 1),
        "truth_round_one_gpu_seconds": round(round_one_seconds, 1),
        "search_seconds": search_seconds,
        # Against one round of the truth: what an exhaustive search of one process per config costs.
        "search_vs_truth_gpu_seconds": round(search_seconds / round_one_seconds, 3) if round_one_seconds else None,
        "gpu_seconds_goal": GPU_SECONDS_GOAL,
        # What a truth of one process per config would have called the best.
        "one_process_truth_best": next(row["label"] for row in table if row["key"] == first_only["key"])
        if first_only
        else None,
        "between_processes_spread": {
            "median": median_of(spreads),
            "max": max(spreads, default=None),
            "configs": len(spreads),
        },
    }


def study_candidates(run: Run, db: str, study: str) -> dict:
    """helper_truth_candidates' answer for the README's study, asked once per state (the truth, the
    spread and probe_overhead each need it; the study does not change once searched)."""
    path = run.state / "truth-candidates.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("study") == study:
            return saved["candidates"]
    candidates = run.helper("truth_candidates", timeout=300, db=db, study=study)
    path.write_text(json.dumps({"study": study, "candidates": candidates}))
    return candidates


def section_truth(run: Run) -> dict:
    """The ground truth that the noise between processes cannot fool: every config of the README's
    search that its memory predictions do not rule out, each probed in fresh processes (round 1 in
    the space's order, round 2 in reverse), its figure the median; the search's pick held against it."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    if not study:
        raise Failed("readme_command recorded no study name")
    candidates = study_candidates(run, db, study)
    # Round 1 starts with what the search measured (its pick, the configs it was told apart from),
    # so that a deadline leaves out the configs it did not measure rather than these.
    ordered = sorted(candidates["measured"], key=lambda c: c["search_status"] not in ("ok", "oom"))
    keys = [c["key"] for c in ordered]
    labels = {c["key"]: c["label"] for c in ordered}
    path = run.state / TRUTH_FILE
    reserve = TRUTH_RESERVE_SECONDS if run.cuda else 0.0

    def figures() -> dict:
        rows = read_rows(path, "truth-")
        table = truth_table(keys, labels, rows)
        return {
            "candidates": candidates["candidates"],
            "measured_configs": len(keys),
            "ruled_out_by_memory": candidates["ruled_out_by_memory"],
            "without_prediction": candidates["without_prediction"],
            "window": candidates["window"],
            "search_confirmation": candidates["confirmation"],
            "contender_share": CONTENDER_SHARE,
            "rounds": {tag: sum(1 for r in rows if r["tag"] == tag) for tag in ("truth-1", "truth-2")},
            **truth_verdict(table, readme, rows),
            "table": table,
            "probes": rows,
        }

    left = run.deadline.left()
    seconds = 1e9 if left is None else left - reserve - WRAP_UP_SECONDS
    if next_truth_round(keys, read_rows(path, "truth-"), True)[1]:
        if seconds < 20:
            raise Pending(
                f"{seconds + reserve:.0f} s left of the {20 + reserve:.0f} the truth needs to probe", figures()
            )
        try:
            # One chain of processes for every round: a probe's process is started while the last runs.
            run.helper(
                "fresh_probes",
                timeout=seconds + KILL_GRACE_SECONDS + 60,
                db=db,
                study=study,
                results=str(path),
                seconds=seconds,
                truth_keys=keys,
                round_one_seconds=ROUND_ONE_SHARE * seconds,
            )
        except SectionEnd as end:
            end.figures = figures()
            raise
    round_name, todo = next_truth_round(keys, read_rows(path, "truth-"), True)
    if todo:
        raise Pending(f"round {round_name} has {len(todo)} configs left; the same command goes on", figures())
    return figures()
