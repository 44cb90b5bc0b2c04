"""benchmarks/suite_cpu.py: each kind of process the suite starts is named from its command line, and
the sampler reads a real process's CPU time and the test that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.suite_cpu import Process, Sampler, by_kind, by_module, kind_of

PYTHON = "/repo/.venv/bin/python"


@pytest.mark.parametrize(
    "command_line, kind",
    [
        (
            f"{PYTHON} -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=6, pipe_handle=8) "
            "--multiprocessing-fork",
            "probe child",
        ),
        (f"{PYTHON} -m autotune.estimate.trace", "trace child"),
        (f"{PYTHON} -u -m autotune.probe.rank_main", "rank"),
        (f"{PYTHON} -u -m autotune.train.rank_main", "rank"),
        (f"{PYTHON} -m torch.distributed.run --nproc-per-node 2 -m autotune.probe.rank_main", "torchrun agent"),
        (f"{PYTHON} -m autotune search --model /tmp/tiny --gpu-budget 1GiB", "cli search"),
        ("/repo/.venv/bin/autotune train --study s", "cli train"),
        (f"{PYTHON} -u -c import sys;exec(eval(sys.stdin.readline()))", "pytest worker"),
        (f"{PYTHON} -m benchmarks.run --device cpu", "benchmarks"),
        ("/usr/bin/sleep 5", "other"),
    ],
)
def test_each_kind_of_process_is_named_from_its_command_line(command_line, kind):
    assert kind_of(command_line) == kind


def test_the_sampler_reads_a_real_process_s_cpu_and_the_test_that_started_it():
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(5)"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        with Sampler() as sampler:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sampler.sample()
                seen = [p for p in sampler.processes.values() if p.pid == child.pid]
                if seen and seen[0].cpu_seconds >= 0.5:
                    break
                time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
    [process] = [p for p in sampler.processes.values() if p.pid == child.pid]
    assert process.cpu_seconds >= 0.5 and "time.process_time()" in process.command_line
    assert process.test == os.environ["PYTEST_CURRENT_TEST"]


def test_cpu_is_added_up_by_kind_and_by_test_module():
    processes = [
        Process(1, "python -m autotune.estimate.trace", "tests/a.py::t (call)", 5.0),
        Process(2, "python -m autotune.estimate.trace", "tests/b.py::u (setup)", 3.0),
        Process(3, "python -m autotune search", "tests/a.py::v (call)", 1.0),
    ]
    assert by_kind(processes) == [("trace child", 2, 8.0), ("cli search", 1, 1.0)]
    assert by_module(processes) == [("tests/a.py", 6.0), ("tests/b.py", 3.0)]


def test_processes_running_before_the_command_are_not_counted(tmp_path):
    import json

    from benchmarks.suite_cpu import main

    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    already = subprocess.Popen([sys.executable, "-c", busy])
    command = "import time\nend = time.process_time() + 1.2\nwhile time.process_time() < end: pass"
    try:
        time.sleep(1.0)
        assert main(["--out", str(tmp_path / "seen.jsonl"), "--", sys.executable, "-c", command]) == 0
    finally:
        already.kill()
        already.wait()
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert already.pid not in {p["pid"] for p in seen}
    assert any("time.process_time() + 1.2" in p["command_line"] for p in seen)  # (the command's own)


def test_a_command_that_cannot_run_is_one_line_and_exit_2(capsys):
    from benchmarks.suite_cpu import main

    assert main(["--", "no-such-command-here"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
