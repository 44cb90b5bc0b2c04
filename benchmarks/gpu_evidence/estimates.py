"""The estimator against the probe (pass 1): the memory prediction for every config the README's
search measured, from the probes it stored rather than new ones, with its errors on the allocated,
reserved and required bytes.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.gpu_evidence.invocation import Run


def section_estimator_vs_probe(run: Run) -> dict:
    """The estimator's prediction against every config the README's search probed."""
    device_type = "cuda" if run.cuda else "cpu"
    return run.helper("estimates", timeout=900, db=run.db("readme.db"), device_type=device_type)


def ratio_error(predicted: int | None, measured: int | None) -> float | None:
    return None if not predicted or not measured else round((predicted - measured) / measured, 4)


def helper_estimates(db: str, device_type: str) -> dict:
    """Estimate vs probe for every distinct config measured in `db` (as benchmarks/estimator_vs_probe.py
    compares them, from stored probes instead of new ones)."""
    from autotune.estimate import estimate_memories
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        records = [r for r in store.probes() if str(r.result.status) in ("ok", "oom") and r.result.peak_allocated_bytes]
    measured = {r.config_key: r for r in records}
    started = time.perf_counter()
    estimates = estimate_memories([r.config for r in measured.values()], device_type=device_type, use_cache=False)
    rows: list[dict[str, Any]] = []
    for record, estimate in zip(measured.values(), estimates):
        result = record.result
        rows.append(
            {
                "label": record.config.label(),
                "status": str(result.status),
                "measured": {
                    "peak_allocated_bytes": result.peak_allocated_bytes,
                    "peak_reserved_bytes": result.peak_reserved_bytes,
                    "context_bytes": result.context_bytes,
                    "required_bytes": result.required_bytes,
                },
                "estimate": {
                    "peak_bytes": estimate.peak_bytes,
                    "reserved_bytes": estimate.reserved_bytes,
                    "context_bytes": estimate.context_bytes,
                    "required_bytes": estimate.required_bytes,
                    "breakdown": estimate.breakdown,
                },
                "error_allocated": ratio_error(estimate.peak_bytes, result.peak_allocated_bytes),
                "error_reserved": ratio_error(estimate.reserved_bytes, result.peak_reserved_bytes),
                "error_required": ratio_error(estimate.required_bytes, result.required_bytes),
            }
        )

    def spread(key: str) -> dict | None:
        # An OOM's peaks are where it stopped, not the config's need: only configs that ran count.
        errors = [abs(row[key]) for row in rows if row["status"] == "ok" and row[key] is not None]
        return (
            {"mean_abs": round(sum(errors) / len(errors), 4), "max_abs": round(max(errors), 4), "n": len(errors)}
            if errors
            else None
        )

    return {
        "device_type": device_type,
        "configs": len(rows),
        "estimate_seconds": round(time.perf_counter() - started, 1),
        "allocated": spread("error_allocated"),
        "reserved": spread("error_reserved"),
        "required": spread("error_required"),
        "rows": rows,
    }
