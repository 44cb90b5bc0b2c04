"""The child side of the truth and the spread: a study's configs probed again as its search probed them
(its plan's settings, on its device, with its budget and margin), each in a fresh process started while
the last probe ran, one JSON line per probe appended to the results as it ends; and which configs the
truth may probe (those the search's memory predictions do not rule out).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_evidence.common import utc_now
from benchmarks.gpu_evidence.truth import next_truth_round, read_rows


@dataclass
class StudyToProbe:
    """What probing a study's configs again as its search probed them takes (read once)."""

    record: Any  # the study's StudyRecord: plan, budget, environment, confirmation
    configs: dict[str, Any]  # each config it holds a probe row for (skipped ones too), by key, as stored
    outcomes: dict[str, str]  # the search's status of each
    settings: Any  # ProbeSettings: the study's plan, on its device, with its margin
    budget: Any  # Budget: the study's, that margin kept

    @classmethod
    def read(cls, db: str, study: str) -> "StudyToProbe":
        from autotune.probe.settings import ProbeSettings
        from autotune.search.study_plan import StudyPlan
        from autotune.store import open_store

        with open_store(db, read_only=True) as store:
            record, probes = store.study(study), store.probes(study)
        configs: dict[str, Any] = {}
        for probe in probes:
            configs.setdefault(probe.config.key(), probe.config)
        device = str(record.environment.get("device_type") or "cuda")
        settings = ProbeSettings.from_plan(
            StudyPlan.from_dict(record.plan).probe, device=device, margin=record.margin_bytes
        )
        return cls(
            record,
            configs,
            {p.config.key(): str(p.result.status) for p in probes},
            settings,
            settings.budget(record.budget_bytes),
        )

    def spec(self) -> Any:
        from autotune.specs.models import resolve_model

        return resolve_model(next(iter(self.configs.values())).model)


def helper_truth_candidates(db: str, study: str) -> dict:
    """Every config of the study's space that its memory predictions do not rule out (the search's
    own rule: a predicted floor over the budget by more than the prediction margin), with the
    search's outcome for each."""
    from autotune.search.study_plan import StudyPlan

    target = StudyToProbe.read(db, study)
    record, configs, outcomes = target.record, list(target.configs.values()), target.outcomes
    plan = StudyPlan.from_dict(record.plan)
    skip_over = int(record.budget_bytes * (1 + plan.predict_margin))
    kept, ruled_out, unpredicted = [], [], []
    for config in configs:
        prediction = plan.predictions.get(config.key())
        if prediction is not None and prediction.floor_bytes > skip_over:
            ruled_out.append(config.label())
            continue
        if prediction is None:
            unpredicted.append(config.label())
        kept.append({"key": config.key(), "label": config.label(), "search_status": outcomes.get(config.key())})
    return {
        "candidates": len(configs),
        "measured": kept,
        "ruled_out_by_memory": ruled_out,
        "without_prediction": unpredicted,
        "budget_bytes": record.budget_bytes,
        "margin_bytes": record.margin_bytes,
        "window": {k: plan.probe.get(k) for k in ("warmup_steps", "measure_steps", "measure_seconds")},
        "confirmation": record.confirmation,
    }


def probe_in_turn(
    batches: Callable[[bool], tuple[str, list[str]]],
    probe: Callable[[str, str], float],
    clock: Callable[[], float],
    seconds: float,
    round_one_seconds: float | None = None,
) -> int:
    """Probe what `batches(closed)` names, batch after batch, until it names nothing or `seconds` run
    out (no probe starts with less left than the longest one so far took); `probe(key, tag)` runs
    one and says its seconds. A batch tagged truth-1 (the truth's round 1) is left, `closed`, once
    `round_one_seconds` have passed, so that the next batch (round 2) comes first. How many probed."""
    started = clock()
    done, longest, closed = 0, 0.0, False
    while True:
        tag, todo = batches(closed)
        if not todo:
            return done
        for key in todo:
            if clock() + longest > started + seconds:
                return done
            if (
                tag == "truth-1"
                and not closed
                and round_one_seconds is not None
                and clock() + longest > started + round_one_seconds
            ):
                closed = True
                break
            longest = max(longest, probe(key, tag))
            done += 1


def helper_fresh_probes(
    db: str,
    study: str,
    results: str,
    seconds: float,
    keys: list[str] | None = None,
    tag: str = "",
    truth_keys: list[str] | None = None,
    round_one_seconds: float | None = None,
) -> dict:
    """Configs of `study`, each probed in a process of its own as the study's search probed (its
    settings and budget), the next process started while the last probe ran; one JSON line per
    probe appended to `results` as it ends. Either `keys` (repeats allowed) under `tag`, or the
    truth's rounds over `truth_keys` (next_truth_round; round 1 closed after `round_one_seconds`)
    in the same processes' chain, for at most `seconds` (probe_in_turn)."""
    from autotune.probe.runner import ProbeRunner

    target = StudyToProbe.read(db, study)
    by_key, settings, budget, spec = target.configs, target.settings, target.budget, target.spec()
    path = Path(results)
    fixed = list(keys or [])

    def batches(closed: bool) -> tuple[str, list[str]]:
        if truth_keys is None:
            todo, fixed[:] = list(fixed), []
            return tag, todo
        round_name, todo = next_truth_round(truth_keys, read_rows(path, "truth-"), closed)
        return f"truth-{round_name}", todo

    with ProbeRunner(settings, reuse_child=False, standby=True) as runner, open(path, "a") as out:

        def probe(key: str, row_tag: str) -> float:
            config = by_key[key]
            result = runner.run(config, budget, spec)
            out.write(
                json.dumps(
                    {
                        "tag": row_tag,
                        "key": key,
                        "label": config.label(),
                        "status": str(result.status),
                        "tokens_per_s": result.tokens_per_s,
                        "step_spread": result.step_spread,
                        "peak_reserved_bytes": result.peak_reserved_bytes,
                        "wall_seconds": result.wall_seconds,
                        "startup_seconds": result.startup_seconds,
                        "build_seconds": result.build_seconds,
                        "measured_seconds": result.measured_seconds,
                        "measured_steps": result.measured_steps,
                        "host_load": result.host_load,
                        "at": utc_now(),
                    }
                )
                + "\n"
            )
            out.flush()
            return result.wall_seconds or 0.0

        done = probe_in_turn(batches, probe, time.monotonic, seconds, round_one_seconds)
    return {"probed": done, "children_started": runner.children_started}
