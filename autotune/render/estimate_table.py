"""The table `autotune estimate` prints: a configuration's predicted memory by what holds it, what
is alive at the peak (and what is not, and why), and the budget's verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.results.budget import Budget
from autotune.levers.evaluation import describe_phases, phases
from autotune.render.tables import describe_task
from autotune.vocabulary.units import format_size, size_as_read

if TYPE_CHECKING:
    from autotune.estimate import MemoryEstimate


def _context_note() -> str:
    """'assumed', or 'measured' where a GPU evidence run recorded the figure (estimate/cuda_constants.py)."""
    from autotune.estimate import cuda_constants

    return "measured" if cuda_constants.load()[cuda_constants.CONTEXT].measured else "assumed"


STATED_LABELS = {"allocated": "peak allocated", "reserved": "peak reserved", "nvidia-smi": "needed on the card"}


def render_estimate(estimate: MemoryEstimate, budget: Budget | None = None) -> str:
    """The table `autotune estimate` prints."""
    e = estimate
    peak = e.peak_bytes or 1

    def row(label: str, value: int, share: bool = True, note: str = "") -> str:
        pct = f"{100 * value / peak:5.1f}%" if share else "      "
        return f"  {label:<24}{format_size(value):>12}  {pct}  {note}".rstrip()

    where = f"predicted for {e.device_type}, " + (
        "from the cache" if e.cached else f"traced in {e.trace_seconds:.1f} s"
    )
    lines = [f"{e.config.model}  {e.config.label()}  ({where})", f"  task: {describe_task(e.config)}"]
    if e.per_rank:
        ranks = ", ".join(f"rank {rank}: {format_size(peaks['allocated'])}" for rank, peaks in e.rank_peaks.items())
        lines.append(
            f"  per rank: one of {e.config.ranks} ranks ({e.config.strategy}), the largest; each rank needs "
            f"this on its own GPU" + (f" ({ranks})" if len(e.rank_peaks) > 1 else "")
        )
    lines.append("")
    lines.append(row("parameters", e.params))
    lines.append(row("gradients", e.grads))
    lines.append(row("optimizer state", e.optimizer))
    lines.append(row("activations", e.activations))
    lines.append(row("temporaries", e.temporaries))
    if e.device_type == "cuda":
        lines.append(row("cuBLAS workspaces", e.workspace))
    lines.append(row("peak allocated", e.peak_bytes, note=f"at the peak: {e.peak_phase}" if e.peak_phase else ""))
    over = e.reserved_bytes - e.peak_bytes
    lines.append(
        row(
            "peak reserved",
            e.reserved_bytes,
            share=False,
            note=f"+{format_size(over)} allocator overhead" if e.device_type == "cuda" else "512-byte rounding",
        )
    )
    if len(phases(e.config)) > 1:  # a run that evaluates: each phase's need (the peak is the largest)
        at_least = " (eval batch 1: the least --eval-batch auto settles for)" if e.config.auto_eval_batch else ""
        unestimated = {phase: "not estimated" for phase in e.unestimated_phases}
        lines.append(f"  phases: {describe_phases(e.config, e.phase_peaks, absent=unestimated)}{at_least}")
    if e.device_type == "cuda":
        lines.append(row("CUDA context", e.context_bytes, share=False, note=_context_note()))
        lines.append(row("needed on the card", e.required_bytes, share=False, note="reserved + context"))

    # What is alive at the peak, and what is not and why, from the estimate's own figures: a
    # gradients row of 0 B is no omission, the peak falls where none exists.
    phase = e.peak_phase or "the step"
    backward, accumulates = phase.startswith("backward"), e.config.grad_accum > 1
    grads = (
        "gradients (the previous micro-steps', kept for accumulation)"
        if phase == "forward" and accumulates
        else "gradients (accumulating over the micro-steps)"
        if backward and accumulates
        else "gradients (made by this backward so far)"
        if backward
        else "gradients (the optimizer step reads them; freed after it)"
        if phase == "optimizer step"
        else "gradients"
    )
    alive = [
        name
        for name, value in (
            ("weights", e.params),
            (grads, e.grads),
            ("optimizer state", e.optimizer),
            ("activations", e.activations),
            ("temporaries", e.temporaries),
            ("cuBLAS workspaces", e.workspace),
        )
        if value > 0
    ]
    absent = []
    if e.grads == 0:
        absent.append(
            "gradients are not made yet: the peak comes early in the backward, before its first gradient"
            if backward
            else "no gradients: this micro-step's backward has not made them yet"
            if phase == "forward"
            else "no gradients"
        )
        absent[-1] += " (they are freed after each optimizer step: zero_grad(set_to_none=True))"
    if e.optimizer == 0:
        absent.append("no optimizer state (the optimizer makes it at its first step)")
    if e.activations == 0:
        absent.append("no activations (the backward has freed them)")
    lines += ["", f"  at the peak ({phase}): " + ", ".join(alive) + "".join(f"; {text}" for text in absent)]
    errors = e.stated_errors()
    if errors:
        lines += ["", "  stated error (benchmarks/published: this estimator against memory measured on real cards):"]
        lines += [f"    {STATED_LABELS[kind]:<20}{error.text()}" for kind, error in errors.items()]
    if budget is not None:
        lines.append("")
        room = budget.headroom(e.required_bytes)
        margin_text = f" with a {format_size(budget.margin_bytes)} margin" if budget.margin_bytes else ""
        need = errors.get("nvidia-smi")
        near = (
            need is not None
            and abs(room) <= need.worst * e.required_bytes
            and f" (inside the stated error of {need.worst:.0%}: a probe decides)"
            or ""
        )
        if room >= 0:
            lines.append(
                f"  budget {size_as_read(budget.total_bytes)}{margin_text}: fits, {format_size(room)} to spare{near}"
            )
        else:
            lines.append(
                f"  budget {size_as_read(budget.total_bytes)}{margin_text}: does NOT fit, {format_size(-room)} over{near}"
            )
    if e.notes:
        lines.append("")
        lines.extend(f"  note: {n}" for n in e.notes)
    return "\n".join(lines)
