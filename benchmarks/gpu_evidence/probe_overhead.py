"""Where a probe's seconds go (pass 2): the pick, another config the search measured, and the pick
again, probed one after another in one warm child by the probe child's own code, each of its steps
timed, with the allocator's retries and the garbage collector's passes counted.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.gpu_evidence.common import Failed
from benchmarks.gpu_evidence.fresh_probes import StudyToProbe
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.truth import study_candidates


def section_probe_overhead(run: Run) -> dict:
    """Where a probe's seconds go, in a warm child: the pick, another config the search measured, the
    pick again (the first probe of a process and the later ones differ on a card)."""
    readme = run.sections["readme_command"]
    db, study = run.db("readme.db"), readme.get("study")
    pick = (readme.get("pick") or {}).get("label")
    measured = [p for p in readme.get("probes_stored", []) if p.get("status") == "ok"]
    by_label = {p["label"]: p for p in measured}
    if pick not in by_label:
        raise Failed(f"the pick {pick!r} is not among the probes the search stored")
    other = next((p for p in measured if p["label"] != pick), by_label[pick])
    candidates = study_candidates(run, db, study)
    key_of = {c["label"]: c["key"] for c in candidates["measured"]}
    keys = [key_of[pick], key_of[other["label"]], key_of[pick]]
    figures = run.helper("probe_phases", timeout=300, db=db, study=study, keys=keys)
    return figures


def helper_probe_phases(db: str, study: str, keys: list[str]) -> dict:
    """Where a probe's seconds go: `keys` (configs of `study`, run as its search ran them) probed one
    after another in this one process by the probe child's own code, as a warm child runs them,
    each step of the child timed (its start: device, NVML, cap; the model's build, the optimizer,
    the step; warm-up; window; release), with the CUDA allocator's retries (an allocation over the
    cap frees the cache and tries again) and the garbage collector's passes. On the H200
    (2026-11-29) gpt2's build took 5.4-7.4 s in every probe of a warm child but its first (0.05 s):
    80% of a probe's time."""
    import gc

    from autotune.probe import child
    from autotune.probe.protocol import ProbeRequest

    target = StudyToProbe.read(db, study)
    by_key, settings, budget, spec = target.configs, target.settings, target.budget, target.spec()
    device = settings.device
    steps: dict[str, float] = {}

    def timed(module: Any, name: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                steps[name] = steps.get(name, 0.0) + time.perf_counter() - started

        setattr(module, name, wrapper)

    for name in (
        "_start",
        "describe",
        "other_gpu_processes",
        "cap_memory",
        "build_random_model",
        "make_optimizer",
        "ProbeStep",
        "parameter_count",
        "_warm_up",
        "_time_window",
        "_release",
        "_judge",
    ):
        timed(child, name)
    collections = {"passes": 0, "seconds": 0.0}
    started_gc = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started_gc[0] = time.perf_counter()
        else:
            collections["passes"] += 1
            collections["seconds"] += time.perf_counter() - started_gc[0]

    gc.callbacks.append(on_gc)
    import torch

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    probes = []
    gc.collect()
    gc.freeze()
    for key in keys:
        steps.clear()
        collections.update(passes=0, seconds=0.0)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None
        marks: list[tuple[str, float]] = [("start", time.perf_counter())]
        request = ProbeRequest(config=by_key[key], model=spec, budget=budget, settings=settings)
        probe = child._probe_in_process(request, lambda phase: marks.append((phase, time.perf_counter())))
        marks.append(("end", time.perf_counter()))
        del probe
        gc.collect()  # what the child's loop leaves for the next probe
        gc.freeze()
        phases = {a: round(t2 - t1, 3) for (a, t1), (_, t2) in zip(marks, marks[1:])}
        probes.append(
            {
                "label": by_key[key].label(),
                "seconds": round(marks[-1][1] - marks[0][1], 3),
                "phases": phases,
                "steps": {k: round(v, 3) for k, v in steps.items()},
                "gc": {"passes": collections["passes"], "seconds": round(collections["seconds"], 3)},
                "alloc_retries": (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries) if cuda else None,
            }
        )
    gc.callbacks.remove(on_gc)
    return {"probes": probes}
