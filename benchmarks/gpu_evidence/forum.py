"""The forum config (pass 1): gpt2 under Trainer's defaults, from the forum report the README starts
from, probed on the whole card and under 8 GiB: its peaks against the forum user's, and the OOM the
smaller budget must give.
"""

from __future__ import annotations

import shlex
from typing import Any

from benchmarks.gpu_evidence.common import GiB, SectionEnd, one_line
from benchmarks.gpu_evidence.invocation import Run

# The public reference the forum config is held against (the forum report the README starts from:
# gpt2 under Trainer's defaults peaking at 8-9 GiB).
FORUM_PEAK_ALLOCATED_GIB, FORUM_PEAK_RESERVED_GIB = 8.06, 8.73


def forum_probes(run: Run) -> dict[str, list[str]]:
    """The forum user's config (Trainer defaults) on the whole card and under 8 GiB; on CPU the same
    levers on the tiny model at block 128, under 1 GiB (room) and 12 MiB (too little)."""
    if run.cuda:
        model, block, device = "gpt2", "512", "cuda"
        budgets = {"whole_card": str(run.doc["device_total_bytes"]), "budget_8GiB": "8GiB"}
        extra: list[str] = []
    else:
        model, block, device = str(run.tiny_model), "128", "cpu"
        budgets = {"whole_card": "1GiB", "budget_8GiB": "12MiB"}
        extra = ["--measure-seconds", "0.2"]
    config = [
        "--model",
        model,
        "--micro-batch",
        "8",
        "--block-size",
        block,
        "--precision",
        "fp32",
        "--attention",
        "sdpa",
        "--optimizer",
        "adamw",
        "--no-checkpointing",
        "--device",
        device,
        *extra,
    ]
    return {name: ["probe", *config, "--gpu-budget", budget, "--json"] for name, budget in budgets.items()}


def section_forum_config(run: Run) -> dict:
    """gpt2, micro-batch 8, block 512, fp32, sdpa, AdamW, no checkpointing: the whole card (the
    user measured 8.06 GiB allocated, 8.73 GiB reserved), and under 8 GiB (expected: oom)."""
    earlier = run.previous("forum_config").get("probes", {})
    probes: dict[str, dict] = {}
    for name, argv in forum_probes(run).items():
        if name in earlier:
            probes[name] = earlier[name]
            continue
        try:
            # Exit 1 is a measurement too: the config does not fit.
            result = run.autotune(*argv, timeout=900).json(accept=(0, 1), what=f"autotune probe ({name})")
        except SectionEnd as end:
            end.figures = {"probes": probes}  # the probe that finished is kept for the next attempt
            raise
        probes[name] = {
            "command": "autotune " + shlex.join(argv),
            "status": result.get("status"),
            **{
                k: result.get(k)
                for k in (
                    "peak_allocated_bytes",
                    "peak_reserved_bytes",
                    "context_bytes",
                    "budget_bytes",
                    "margin_bytes",
                    "cap_bytes",
                    "tokens_per_s",
                    "step_seconds",
                    "wall_seconds",
                )
            },
            "error": one_line(result.get("error") or "") or None,
        }
    whole = probes["whole_card"]
    figures: dict[str, Any] = {
        "probes": probes,
        "small_budget_ooms_as_expected": probes["budget_8GiB"]["status"] == "oom",
    }
    if run.cuda and whole.get("peak_allocated_bytes"):
        figures["vs_forum"] = {
            "forum_peak_allocated_gib": FORUM_PEAK_ALLOCATED_GIB,
            "forum_peak_reserved_gib": FORUM_PEAK_RESERVED_GIB,
            "peak_allocated_ratio": round(whole["peak_allocated_bytes"] / GiB / FORUM_PEAK_ALLOCATED_GIB, 3),
            "peak_reserved_ratio": round((whole.get("peak_reserved_bytes") or 0) / GiB / FORUM_PEAK_RESERVED_GIB, 3),
        }
    return figures
