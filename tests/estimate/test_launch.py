"""The estimator's trace children as a search uses them: started ahead, paused during a probe's
timed window, killed with the search."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from autotune.estimate.launch import TraceChildren

pytestmark = pytest.mark.slow


def state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()[0]


def test_paused_trace_children_are_stopped_until_resumed_and_killed_on_close():
    with TraceChildren(2).start() as tracers:
        pids = [child._process.pid for child in tracers.children]
        tracers.pause()
        time.sleep(0.2)
        assert [state(pid) for pid in pids] == ["T", "T"]  # stopped: no CPU taken from a timed window
        tracers.resume()
        time.sleep(0.2)
        assert "T" not in [state(pid) for pid in pids]
    time.sleep(0.2)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or state(pid) in ("Z", "X")
