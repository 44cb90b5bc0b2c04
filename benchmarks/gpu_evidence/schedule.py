"""The deadline and resume bookkeeping: the selected sections in SECTIONS' order, each skipped when an
earlier command finished it (measured or skipped, in the state's document), not started without the
seconds it needs or before the sections it needs are measured; its record (status, seconds summed over
its attempts, figures) saved after it; SIGTERM leaving the section in flight pending; the exit status.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from typing import Any

from benchmarks.gpu_evidence.common import (
    EVIDENCE_FILE,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_PENDING,
    Interrupted,
    Pending,
    SectionEnd,
    Skip,
    is_done,
    one_line,
)
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.passes import SECTION_NAMES, SECTIONS, Section


def attempt(run: Run, section: Section) -> dict:
    """Run one section; its record (status, seconds, figures)."""
    earlier = run.previous(section.name)
    started = time.monotonic()
    figures: dict[str, Any] = {}
    try:
        if section.cuda_only and not run.cuda:
            raise Skip("needs CUDA")
        for need in section.needs:
            status = run.sections.get(need, {}).get("status", "pending")
            if status.startswith("skipped"):
                raise Skip(f"{need} was skipped")
            if status != "measured":
                raise Pending(f"waits for {need} ({status.split(':')[0]})", earlier)
        left = run.deadline.left()
        needs = section.min_seconds(run.mode)
        if left is not None and left < needs:
            raise Pending(f"not reached: {left:.0f} s left of the {needs:.0f} it needs", earlier)
        figures, status = section.function(run), "measured"
    except SectionEnd as end:
        figures, status = end.figures, end.status
    except Exception as exc:  # a section's bug or an output it did not expect: recorded, the next goes on
        run.log.write(traceback.format_exc())
        status = f"failed: {type(exc).__name__}: {one_line(str(exc))}"
    # Summed over the attempts: a section that resumes across commands costs all of them.
    seconds = earlier.get("seconds", 0.0) + time.monotonic() - started
    return {
        "status": status,
        "seconds": round(seconds, 1),
        **{k: v for k, v in figures.items() if k not in ("status", "seconds")},
    }


def run_sections(run: Run, selected: Sequence[str]) -> int:
    """Each selected section not already done, in order; the exit status."""
    try:
        for section in SECTIONS:
            if section.name not in selected:
                continue
            status = str(run.sections.get(section.name, {}).get("status"))
            if is_done(status):
                run.say(
                    f"{section.name}: already {status.split(':')[0]} (in {run.state / EVIDENCE_FILE}); not run again"
                )
                continue
            run.say(
                f"{section.name}: starting"
                + (f" ({run.deadline.left():.0f} s left)" if run.deadline.left() is not None else "")
            )
            run.sections[section.name] = attempt(run, section)
            run.say(
                f"{section.name}: {run.sections[section.name]['status']} ({run.sections[section.name]['seconds']} s)"
            )
            run.save()
    except (Interrupted, KeyboardInterrupt):
        run.say("stopped (SIGTERM or Ctrl-C): the section in flight stays pending; the same command goes on")
        run.save()
        return EXIT_PENDING
    statuses = [run.sections[name]["status"] for name in selected]
    if any(s.startswith("failed") for s in statuses):
        return EXIT_FAILED
    return EXIT_DONE if all(is_done(s) for s in statuses) else EXIT_PENDING


def pending_sections(doc: dict) -> None:
    """Every section named in the document, those never run as pending."""
    sections = doc["sections"]
    doc["sections"] = {
        name: sections.get(name) or {"status": "pending: not run yet", "seconds": 0.0} for name in SECTION_NAMES
    }


def on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted
