"""Every CUDA claim of autotune measured on a real card, into one JSON, under a wall-clock deadline.

The command line, `python -m benchmarks.gpu_evidence --out DIR ...` (the package's docstring says how
it goes): the arguments checked (a mistake is one line, exit status 2, nothing written), the card and
the earlier document read, the state prepared, and the selected sections run to the deadline. The
first paragraph above is --help's description.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from autotune.host.environment import cpu_name
from benchmarks.gpu_evidence.common import EVIDENCE_FILE, EXIT_USAGE, LOG_FILE, UsageError, utc_now
from benchmarks.gpu_evidence.document import cuda_device, load_document, new_document
from benchmarks.gpu_evidence.invocation import Run
from benchmarks.gpu_evidence.passes import PASSES, SECTION_NAMES
from benchmarks.gpu_evidence.schedule import on_sigterm, pending_sections, run_sections
from benchmarks.run import TINY_GPT2, Deadline


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m benchmarks.gpu_evidence", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"directory for {EVIDENCE_FILE} and {LOG_FILE}")
    p.add_argument("--state", help="directory keeping finished work between commands [default: --out]")
    p.add_argument(
        "--deadline", type=float, help="seconds this command may take; no section starts that cannot end in them"
    )
    p.add_argument("--sections", help=f"comma list of {', '.join(SECTION_NAMES)} [default: all]")
    p.add_argument(
        "--pass",
        dest="pass_",
        choices=sorted(PASSES),
        help="the sections of one GPU command: " + "; ".join(f"{p} {','.join(n)}" for p, n in PASSES.items()),
    )
    p.add_argument(
        "--cpu", action="store_true", help="the CPU mode: a tiny GPT-2, MiB budgets, CUDA-only sections skipped"
    )
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    args = build_parser().parse_args(argv)
    if args.sections and args.pass_:
        raise UsageError("give --sections or --pass, not both")
    named = args.sections or ",".join(PASSES[args.pass_] if args.pass_ else SECTION_NAMES)
    selected = [s.strip() for s in named.split(",") if s.strip()]
    unknown = [s for s in selected if s not in SECTION_NAMES]
    if unknown or not selected:
        raise UsageError(
            f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTION_NAMES)}"
        )
    if args.deadline is not None and args.deadline <= 0:
        raise UsageError(f"--deadline must be a positive number of seconds (got {args.deadline:g})")
    return args, selected


def prepare_state(run: Run) -> None:
    """Directories and the model configs every mode uses (their paths are part of probe keys, so
    they stay in the state, at the same place across commands)."""
    (run.state / "home").mkdir(parents=True, exist_ok=True)
    run.tiny_model.mkdir(parents=True, exist_ok=True)
    (run.tiny_model / "config.json").write_text(json.dumps(TINY_GPT2))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    deadline_start = time.monotonic()
    try:
        args, selected = parse(argv)
        mode = "cpu" if args.cpu else "cuda"
        device = {"device": f"cpu: {cpu_name()}"} if args.cpu else cuda_device()
        out = Path(args.out).resolve()
        state = Path(args.state).resolve() if args.state else out
        doc = load_document(state, new_document(mode, device, argv))
    except UsageError as exc:
        print(f"gpu_evidence: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    seconds = None if args.deadline is None else args.deadline - (time.monotonic() - deadline_start)
    out.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    pending_sections(doc)
    signal.signal(signal.SIGTERM, on_sigterm)
    with open(out / LOG_FILE, "a") as log:
        run = Run(out=out, state=state, mode=mode, deadline=Deadline(seconds), log=log, doc=doc)
        run.say(
            f"gpu_evidence {utc_now()}: {mode} mode on {doc['device']}; sections {', '.join(selected)}; "
            f"state {state}" + (f"; deadline {seconds:.0f} s" if seconds is not None else "")
        )
        prepare_state(run)
        run.save()
        status = run_sections(run, selected)
        summary = ", ".join(f"{name} {run.sections[name]['status'].split(':')[0]}" for name in selected)
        run.say(f"done (exit {status}): {summary}")
    return status


if __name__ == "__main__":
    sys.exit(main())
