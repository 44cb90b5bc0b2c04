"""`pytest -m gpu` (pass 1): on the card one test per pytest process, so that a deadline costs only the
test in flight and the next command goes on from there; in the CPU mode one verbose run in which each
GPU test says why it skips. And pytest's output read back: the nodes, their outcomes, the counts.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from benchmarks.gpu_evidence.children import Outcome
from benchmarks.gpu_evidence.common import REPO, Failed, Pending, last_line, one_line
from benchmarks.gpu_evidence.invocation import Run


def gpu_test_files() -> list[str]:
    """The test files that carry the gpu mark: collecting only these is 0.5 s on CPU against 7 s for
    the whole suite, where every GPU test skips anyway."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for number, word in PYTEST_COUNT.findall(text):
        key = "error" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


def node_outcome(outcome: Outcome) -> dict:
    """One GPU test's result from its pytest run's output."""
    counts = pytest_counts("\n".join(outcome.stdout.splitlines()[-5:]))
    result: dict[str, Any] = {"seconds": round(outcome.seconds, 1)}
    if outcome.returncode not in (0, 1):
        result["outcome"] = "error"
    elif counts.get("failed") or counts.get("error"):
        result["outcome"] = "failed"
    elif counts.get("passed"):
        result["outcome"] = "passed"
    elif counts.get("skipped"):
        result["outcome"] = "skipped"
    else:
        result["outcome"] = "unknown"
    if result["outcome"] in ("failed", "error", "unknown"):
        summary = [line for line in outcome.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
        result["message"] = one_line(summary[0] if summary else last_line(outcome.stdout), 500)
    return result


def section_pytest_gpu(run: Run) -> dict:
    """`pytest -m gpu`, one test per pytest run, so that a deadline costs only the test in flight
    and the next run goes on from there. Every test runs even after one fails (unlike -x): each is
    its own evidence, and a rerun would otherwise repeat the failure to reach the others."""
    base = [run.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    # A test module that cannot be imported here (a dev-only package the GPU image lacks) must not
    # hide the GPU tests of the others.
    collect = [
        run.python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "--collect-only",
        "--continue-on-collection-errors",
    ]
    # On a card the whole suite is collected (a GPU test outside the files that say so would be
    # missed otherwise); on CPU only the files with the mark, to keep the CPU mode short.
    paths = [] if run.cuda else gpu_test_files()
    # Without a card every GPU test only says why it skips: one verbose pytest process collects and
    # runs them all (each in its own would start Python, torch and transformers a dozen times over
    # for nothing, and a separate collection once more).
    collected = run.command([*collect, *paths], timeout=300) if run.cuda else cpu_mode_run(run, paths)
    if collected.cut:
        raise Pending("collection was stopped at the deadline")
    nodes = collected_nodes(collected.stdout, verbose=not run.cuda)
    if not nodes:
        raise Failed(f"pytest -m gpu collected no test: {last_line(collected.stdout)}")
    earlier = run.previous("pytest_gpu").get("tests", {})
    tests: dict[str, dict] = {} if run.cuda else cpu_mode_outcomes(collected, nodes)
    for node in nodes:
        if node in tests:
            continue
        before = earlier.get(node, {})
        if before.get("outcome") in ("passed", "failed", "skipped", "error"):
            tests[node] = before
            continue
        left = run.deadline.left()
        if left is not None and left < 60:
            break
        outcome = run.command([*base, node], timeout=900)
        if outcome.cut:
            cuts = before.get("cut_by_deadline", 0) + 1
            # A test longer than a whole call never ends: say so after the second cut.
            tests[node] = (
                {"outcome": "error", "message": "stopped at the deadline twice: longer than one call"}
                if cuts >= 2
                else {"outcome": "cut", "cut_by_deadline": cuts}
            )
            break
        tests[node] = node_outcome(outcome)
        run.say(f"  {node}: {tests[node]['outcome']}")
    counts: dict[str, int] = {}
    for result in tests.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    unimportable = [
        line.split()[1] for line in collected.stdout.splitlines() if line.startswith("ERROR ") and len(line.split()) > 1
    ]
    figures = {
        "collected": len(nodes),
        "counts": counts,
        "tests": tests,
        "modules_not_collected": unimportable,
        "command": shlex.join(["python", *base[1:]]) + " NODE (each)",
    }
    if len(tests) < len(nodes) or counts.get("cut"):
        raise Pending(f"{len(nodes) - len(tests) + counts.get('cut', 0)} tests not run before the deadline", figures)
    return figures


PYTEST_VERBOSE_LINE = re.compile(r"^(\S+::.*?) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)\b")


def collected_nodes(stdout: str, verbose: bool) -> list[str]:
    """The test ids a pytest run named: `--collect-only -q` prints one per line; `-v` one per line
    followed by its outcome (and the summary's `FAILED NODE - why` lines, which are not read)."""
    if verbose:
        return [found.group(1) for line in stdout.splitlines() if (found := PYTEST_VERBOSE_LINE.match(line))]
    return [line.strip() for line in stdout.splitlines() if "::" in line and not line.startswith(" ")]


def cpu_mode_run(run: Run, paths: list[str]) -> Outcome:
    """One verbose pytest run of the GPU tests in `paths`: `NODE SKIPPED (reason)` per line."""
    return run.command([run.python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", *paths], timeout=900)


def cpu_mode_outcomes(outcome: Outcome, nodes: list[str]) -> dict[str, dict]:
    """The GPU tests' outcomes from cpu_mode_run's output; a node it does not name is left for the
    one-per-run loop."""
    found: dict[str, dict] = {}
    for node in nodes:
        line = next((line for line in outcome.stdout.splitlines() if line.startswith(node + " ")), "")
        word = line[len(node) + 1 :].split(" ", 1)[0].lower() if line else ""
        if word in ("passed", "skipped", "failed", "error"):
            found[node] = {"outcome": word, "seconds": round(outcome.seconds / len(nodes), 1)}
            if word in ("failed", "error"):
                found[node]["message"] = one_line(line, 500)
    return found
