"""The CUDA facts and the micro-checks: what autotune took from reading torch's and transformers'
sources, checked on the card. cuda_facts (pass 1) holds what the estimator's constants rest on (the
cap raising OOM, the context after a step, cuBLAS's workspace); micro_checks (pass 3) the rest. Each
check runs in a process of its own and a section resumes one check at a time. cuda_constants records
the context and the workspace that cuda_facts measured where the estimator reads them. What each
check runs on the card is in check_helpers.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
import traceback
from collections.abc import Callable, Sequence

from autotune.levers.speed_levers import ALLOC_CONF_VARS, allocator_environment
from benchmarks.gpu_evidence.common import REPO, Failed, Pending, SectionEnd, Skip, is_done, one_line, utc_now
from benchmarks.gpu_evidence.invocation import Run

# Each micro-check: a name, what it runs, and the seconds it needs at least (it is not started with less).
MicroCheck = tuple[str, Callable[["Run"], dict], float]


def check_cap_oom(allocator: str) -> Callable[[Run], dict]:
    def check(run: Run) -> dict:
        return run.helper("cap_oom", timeout=120, env=allocator_environment(allocator))

    return check


def check_allocator_var_priority(run: Run) -> dict:
    """Which of the two variables torch reads when both are set, each way round, with the two
    single-variable cases as controls that the detection itself works."""
    cases: dict[str, dict[str, str | None]] = {
        "alloc_false_cuda_true": {
            "PYTORCH_ALLOC_CONF": "expandable_segments:False",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        },
        "alloc_true_cuda_false": {
            "PYTORCH_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
        },
        "cuda_true_only": {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        "neither": {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None},
    }
    results = {name: run.helper("allocator_settings", timeout=120, env=env) for name, env in cases.items()}
    a, b = results["alloc_false_cuda_true"]["expandable"], results["alloc_true_cuda_false"]["expandable"]
    controls_ok = results["cuda_true_only"]["expandable"] is True and results["neither"]["expandable"] is False
    winner = (
        "PYTORCH_ALLOC_CONF"
        if (a, b) == (False, True)
        else "PYTORCH_CUDA_ALLOC_CONF"
        if (a, b) == (True, False)
        else "neither consistently"
    )
    return {
        "cases": results,
        "winner": winner,
        "detection_controls_ok": controls_ok,
        "autotune_assumes": ALLOC_CONF_VARS[0],
    }


def check_handoff_compile(run: Run) -> dict:
    """The hand-off's TrainingArguments for a compiled fp32 winner, 2 Trainer steps of a tiny model;
    and the same without `tf32`, which is what transformers would do without the hand-off's word."""
    out = run.state / "tmp" / "handoff"
    return {
        "handoff": run.helper(
            "handoff_compile",
            timeout=420,
            model_dir=str(run.tiny_model),
            output_dir=str(out / "with-tf32"),
            drop_tf32=False,
        ),
        "without_tf32_key": run.helper(
            "handoff_compile",
            timeout=420,
            model_dir=str(run.tiny_model),
            output_dir=str(out / "without-tf32"),
            drop_tf32=True,
        ),
    }


def check_bitsandbytes_import(run: Run) -> dict:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed (../shared/gpu/wheels.sh bitsandbytes==0.50.2)")
    return run.helper("bitsandbytes_import", timeout=120)


# The CUDA facts the estimator's constants rest on (pass 1): the cap raising OOM, the context, cuBLAS.
CUDA_FACTS: tuple[MicroCheck, ...] = (
    ("cap_oom_default", check_cap_oom("default"), 30),
    ("cap_oom_expandable", check_cap_oom("expandable"), 30),
    ("context_after_step", lambda run: run.helper("context_after_step", timeout=180), 60),
    ("cublas_workspace", lambda run: run.helper("cublas_workspace", timeout=120), 30),
)
# The other facts autotune took from reading torch's and transformers' sources, checked on the card.
MICRO_CHECKS: tuple[MicroCheck, ...] = (
    ("context_with_other_process", lambda run: run.helper("context_with_other_process", timeout=180), 60),
    ("device_assert_then_mem_get_info", lambda run: run.helper("device_assert", timeout=120), 30),
    ("allocator_var_priority", check_allocator_var_priority, 90),
    ("bitsandbytes_import", check_bitsandbytes_import, 30),
    ("tf32_compile_handoff", check_handoff_compile, 240),
)


def run_checks(run: Run, section: str, listed: Sequence[MicroCheck]) -> dict:
    """Each check in a process of its own; one already measured by an earlier attempt is kept, a
    failed one tried again."""
    earlier = run.previous(section).get("checks", {})
    checks: dict[str, dict] = {}
    for name, check, needs in listed:
        if is_done(earlier.get(name, {}).get("status")):
            checks[name] = earlier[name]
            continue
        left = run.deadline.left()
        if left is not None and left < needs:
            checks[name] = {"status": f"pending: {left:.0f} s left of the {needs:.0f} it needs"}
            continue
        started = time.monotonic()
        try:
            figures, status = check(run), "measured"
        except SectionEnd as end:
            figures, status = end.figures, end.status
        except Exception as exc:  # an answer the check did not expect: this check fails, the others go on
            run.log.write(traceback.format_exc())
            figures, status = {}, f"failed: {type(exc).__name__}: {one_line(str(exc))}"
        checks[name] = {"status": status, "seconds": round(time.monotonic() - started, 1), **figures}
        run.say(f"  {section}.{name}: {status}")
        if status.startswith("pending"):
            break
    failed = [name for name, c in checks.items() if c["status"].startswith("failed")]
    pending = [name for name, c in checks.items() if c["status"].startswith("pending")]
    figures = {"checks": checks}
    if failed:
        raise Failed(f"checks {', '.join(failed)} failed (the next run tries them again)", figures)
    if pending or len(checks) < len(listed):
        raise Pending(f"checks {', '.join(pending) or 'left'} not reached", figures)
    return figures


def section_cuda_facts(run: Run) -> dict:
    return run_checks(run, "cuda_facts", CUDA_FACTS)


def section_micro_checks(run: Run) -> dict:
    return run_checks(run, "micro_checks", MICRO_CHECKS)


def section_cuda_constants(run: Run) -> dict:
    """The context and the cuBLAS workspaces that cuda_facts measured, recorded where the
    estimator reads them (autotune/estimate/cuda_constants.json) and copied into --out, since the
    GPU machine's working tree does not come back."""
    from autotune.estimate.cuda_constants import CONTEXT, CUBLAS_WORKSPACES, FILE, record_measured

    checks = run.sections["cuda_facts"]["checks"]
    context = checks["context_after_step"]["after_bf16_step"]["measure_cuda_context_bytes"]
    workspace = checks["cublas_workspace"]["workspace_bytes"]
    where = f"{run.doc['device']}, driver {run.doc['driver']}, torch {run.doc['torch']}, {utc_now()[:10]}"
    record_measured(CONTEXT, int(context), where)
    record_measured(CUBLAS_WORKSPACES, int(workspace), where)
    shutil.copy(FILE, run.out / FILE.name)
    readme = run.sections.get("readme_command", {})
    probe_contexts = [p["context_bytes"] for p in readme.get("probes_stored", []) if p.get("context_bytes")]
    return {
        "recorded": {CONTEXT: int(context), CUBLAS_WORKSPACES: int(workspace)},
        "where": where,
        "file": str(FILE.relative_to(REPO)),
        "copied_to": FILE.name,
        "readme_probe_context_bytes": {"min": min(probe_contexts), "max": max(probe_contexts)}
        if probe_contexts
        else None,
    }
