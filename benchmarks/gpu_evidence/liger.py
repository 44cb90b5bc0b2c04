"""Liger's kernels and the allocator's expandable segments as levers (pass 3): a search on
TinyLlama-1.1B's shape with both, and what each lever buys in speed and memory on the card.
"""

from __future__ import annotations

import importlib.util
import json

from benchmarks.estimator_vs_probe import TINYLLAMA_1_1B
from benchmarks.gpu_evidence.common import Skip
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.search import run_search


def section_liger_allocator_search(run: Run) -> dict:
    """A search on TinyLlama-1.1B's shape with Liger's kernels and the allocator's expandable
    segments as levers: what each buys in speed and memory on the card."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger_kernel is not installed (../shared/gpu/wheels.sh bitsandbytes==0.50.2 liger-kernel)")
    model = run.state / "llama-1b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINYLLAMA_1_1B))
    db = run.db("liger.db")
    args = [
        "--model",
        str(model),
        "--gpu-budget",
        "32GiB",
        "--micro-batches",
        "2,4,8",
        "--effective-batch",
        "8",
        "--block-sizes",
        "1024",
        "--precisions",
        "bf16",
        "--checkpointing",
        "off",
        "--attention",
        "sdpa",
        "--liger",
        "off,on",
        "--allocators",
        "default,expandable",
    ]
    figures = run_search(run, run.previous("liger_allocator_search"), args, db)
    figures["levers"] = lever_effects(figures["probes_stored"])
    return figures


def lever_effects(probes: list[dict]) -> list[dict]:
    """Per config apart from the two levers: tokens/s and peak reserved with each lever value."""
    groups: dict[str, dict[str, dict]] = {}
    for p in probes:
        if p.get("status") != "ok":
            continue
        rest = {k: v for k, v in p["config"].items() if k not in ("liger", "allocator")}
        key = json.dumps(rest, sort_keys=True)
        groups.setdefault(key, {})[
            f"liger={'on' if p['config'].get('liger') else 'off'} allocator={p['config'].get('allocator')}"
        ] = {"tokens_per_s": p.get("tokens_per_s"), "peak_reserved_bytes": p.get("peak_reserved_bytes")}
    return [{"config": json.loads(key), "by_lever": values} for key, values in groups.items()]
