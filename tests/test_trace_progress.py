"""The progress of `plan` and `estimate` traces (autotune.render.live.trace_progress): a line at most every
10 s in a pipe, so that a piped command is not silent for minutes; a line redrawn in place on a
terminal; nothing at all when quiet (--json)."""

from __future__ import annotations

import io
import time

from autotune.render.live import TraceProgress, trace_progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_pipe_a_line_at_most_every_ten_seconds_and_the_last_count():
    clock, out = Clock(), io.StringIO()
    progress = TraceProgress(out, tty=False, clock=clock)
    progress.tick()
    clock.now += 9
    progress(1, 16)
    progress.tick()
    assert out.getvalue() == ""  # nothing before 10 s
    clock.now += 1.5
    progress.tick()  # the clock alone keeps saying it goes on
    clock.now += 20
    progress(3, 16)  # 20 s later: due
    progress(4, 16)  # at once after: not due
    clock.now += 12
    progress.tick()
    progress(16, 16)  # the last count, always, once anything was said
    progress.tick()
    assert out.getvalue().splitlines() == [
        "traced 1 of 16 (10 s)",
        "traced 3 of 16 (30 s)",
        "traced 4 of 16 (42 s)",
        "traced 16 of 16 (42 s)",
    ]


def test_work_done_within_ten_seconds_says_nothing_in_a_pipe():
    clock, out = Clock(), io.StringIO()
    progress = TraceProgress(out, tty=False, clock=clock)
    clock.now += 3
    progress(16, 16)
    progress.close()
    assert out.getvalue() == ""


def test_before_any_count_the_work_is_named():
    clock, out = Clock(), io.StringIO()
    progress = TraceProgress(out, tty=False, what="tracing gpt2 mb8x1 blk512 fp32 no-ckpt sdpa", clock=clock)
    clock.now += 10
    progress.tick()
    assert out.getvalue() == "tracing gpt2 mb8x1 blk512 fp32 no-ckpt sdpa (10 s)\n"


def test_on_a_terminal_one_line_redrawn_and_ended():
    clock, out = Clock(), Terminal()
    progress = TraceProgress(out, tty=True, clock=clock)
    clock.now += 1
    progress.tick()
    progress(2, 4)
    progress(4, 4)
    progress.close()  # already ended: kept as it is
    assert out.getvalue() == "\r\033[Ktracing (1 s)\r\033[Ktraced 2 of 4 (1 s)\r\033[Ktraced 4 of 4 (1 s)\n"
    # Work without counts (estimate), or that fails: the line is cleared for what is printed next.
    out = Terminal()
    progress = TraceProgress(out, tty=True, what="tracing mb8x1", clock=clock)
    progress.tick()
    progress.close()
    assert out.getvalue() == "\r\033[Ktracing mb8x1 (0 s)\r\033[K"


def test_quiet_prints_nothing_and_the_context_stops_its_clock():
    out = io.StringIO()
    with trace_progress(quiet=True, stream=out) as progress:
        progress(1, 2)
    assert out.getvalue() == ""
    with trace_progress(stream=out, every=0.05) as progress:  # a pipe: the clock thread ticks
        time.sleep(0.3)
        progress(1, 1)
    assert out.getvalue().startswith("tracing (0 s)\n")
    assert out.getvalue().endswith("traced 1 of 1 (0 s)\n")
    settled = out.getvalue()
    time.sleep(0.2)
    assert out.getvalue() == settled  # the clock stopped with the block


def test_quiet_with_the_progress_lines_asked_for_writes_each_count_for_a_reader(monkeypatch):
    """A program that runs `plan --json` (the service) asks for the counts as lines on stderr: each
    one, and nothing else, which read_progress reads back; any other line reads as none."""
    from autotune.render.live import PROGRESS_ENV, read_progress

    monkeypatch.setenv(PROGRESS_ENV, "1")
    out = io.StringIO()
    with trace_progress(quiet=True, stream=out) as progress:
        progress(1, 8)
        progress(8, 8)
    lines = out.getvalue().splitlines()
    assert [read_progress(line) for line in lines] == [(1, 8), (8, 8)]
    assert read_progress("autotune: error: --tokens '0': a run trains at least one token") is None
    assert read_progress("traced 1 of 8 (3 s)") is None  # (a person's line, not the reader's)
