"""`autotune search` on a terminal shows the probe in flight, live; in a log it does not."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time

import pytest

from tests.helpers.cli import autotune_command, invoke
from tests.helpers.faults import fault_env

SPACE = [
    "--gpu-budget",
    "2GiB",
    "--device",
    "cpu",
    "--micro-batches",
    "2,4",
    "--block-sizes",
    "64",
    "--effective-batch",
    "4",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off",
    "--attention",
    "sdpa",
    "--no-predict",
    "--no-confirm",
]


def run_on_a_terminal(
    args: list[str], timeout: float = 180, env: dict[str, str] | None = None
) -> list[tuple[float, str]]:
    """Run the command with a pseudo-terminal as stdout and stderr: what it wrote, with when."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(autotune_command(*args), stdin=slave, stdout=slave, stderr=slave, close_fds=True, env=env)
    os.close(slave)
    chunks: list[tuple[float, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the terminal closed: the command ended
                    break
                if not data:
                    break
                chunks.append((time.monotonic(), data.decode(errors="replace")))
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        proc.wait(timeout=30)
    assert proc.returncode == 0, "".join(text for _, text in chunks)
    return chunks


@pytest.mark.slow
def test_a_search_on_a_terminal_shows_the_probe_in_flight_and_replaces_it_with_the_result(tiny_model, tmp_path):
    # A timed window of 20 steps of a tenth of a second each at least (tests/helpers/faults: `slow`),
    # so that the live line is redrawn while the probe runs, on any machine.
    chunks = run_on_a_terminal(
        ["search", "--model", tiny_model, *SPACE, "--measure-steps", "20", "--db", str(tmp_path / "a.db")],
        env=fault_env("slow"),
    )
    text = "".join(t for _, t in chunks)
    drawn = [line for line in re.split(r"\r\x1b\[K|\r\n", text) if line.startswith("[1/2] mb")]
    live = [line for line in drawn if " ok " not in line]
    # Drawn when the probe starts (0 s in), then at each phase and every half second: the elapsed
    # time grows while the same probe runs, until its result line replaces it.
    assert live and live[0].endswith("starting, 0 s"), drawn
    assert any(re.search(r"timing steps, [1-9]\d* s$", line) for line in live), live
    assert "building the model" in text and "warm-up steps" in text
    result = next(line for line in drawn if " ok " in line)
    assert drawn.index(result) > drawn.index(live[-1])
    # When it first showed, the header had just been written: the probe in flight is on screen
    # within 2 s of the search starting to probe.
    header = next(when for when, t in chunks if "candidate configs" in t)
    first_live = next(when for when, t in chunks if "[1/2] mb" in t)
    assert first_live - header < 2.0


@pytest.mark.slow
def test_in_a_log_there_is_no_live_line(tiny_model, tmp_path, warm_child):
    # (In this process: its output, as a log's, is no terminal.)
    proc = invoke("search", "--model", tiny_model, *SPACE, "--db", str(tmp_path / "b.db"))
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[K" not in proc.stdout + proc.stderr and "\r" not in proc.stdout
    assert re.search(r"^\[1/2\] mb\dx\d .* ok ", proc.stdout, re.M)
