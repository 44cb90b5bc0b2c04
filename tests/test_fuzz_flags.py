"""Hostile values in every flag of every command, through the real entry point (`autotune.cli.app.main`)
in this process: negative, zero, past 64 bits, nan and inf, 1e308, empty, not a number, lone
surrogates (what a non-UTF-8 argv decodes to), very long. Whatever the value, a command ends with a
documented exit status (0, 1, 2, 3), never a traceback; a refusal (2) is one line on stderr and
leaves the database as it was; and no process is left behind.

The flags are read from click's command objects, so a flag added later is fuzzed too. Nothing may
probe for real: each command gets base arguments that stop it before any work once the fuzzed flag
is read (a model directory that does not exist, a study that does not exist), a non-slow test may
start no probe or trace process (tests/conftest.py fails the case if one starts), `node`'s serving
loop is replaced by a stand-in, and every case runs under a deadline."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from unittest import mock

import click
import pytest
from click.testing import CliRunner

import autotune.cli  # noqa: F401 (registers the commands)
from autotune.cli.app import cli, main
from tests.helpers.processes import children

HOSTILE = {
    "negative": "-1",
    "zero": "0",
    "1e20": str(10**20),
    "2**63": str(2**63),
    "int64-max": str(2**63 - 1),
    "nan": "nan",
    "inf": "inf",
    "1e308": "1e308",
    "empty": "",
    "not-a-number": "abc",
    "surrogates": "\udcff\udcfe",  # bytes 0xff 0xfe in argv, as Python decodes them
    "long-digits": "9" * 5000,
    "long-text": "x" * 5000,  # a path component past NAME_MAX too
}
MISSING = "no-such-model-dir"
# Arguments that make each command stop before any work once the fuzzed flag is accepted: a model
# that is not there (refused before any process), a study that is not there.
BASE = {
    "probe": ["--model", MISSING, "--micro-batch", "1", "--block-size", "8", "--gpu-budget", "1GiB", "--device", "cpu"],
    "estimate": ["--model", MISSING, "--micro-batch", "1", "--block-size", "8"],
    "search": ["--model", MISSING, "--gpu-budget", "1GiB", "--device", "cpu"],
    "plan": ["--model", MISSING, "--gpu", "h100"],
    "train": ["--model", MISSING, "--gpu-budget", "1GiB", "--dataset", "no-such-data.txt", "--device", "cpu"],
    "worker": ["--study", "no-such-study", "--device", "cpu"],
    "node": ["--rendezvous", "127.0.0.1:29500", "--nodes", "2", "--node-rank", "1", "--device", "cpu"],
    "leaderboard": ["--study", "no-such-study"],
    "best": ["--study", "no-such-study"],
    "runs": ["--study", "no-such-study"],
    "plot": ["--study", "no-such-study"],
    "report": ["--study", "no-such-study"],
    "serve": ["--port", "8999"],
}
DOCUMENTED_EXITS = {0, 1, 2, 3}
# Cases this fuzzing found whose fix belongs to code another change is rewriting at the time of
# writing: reported, and allowed to fail here until then (they pass too).
KNOWN_ELSEWHERE: dict[tuple[str, str, str], str] = {}  # (command, flag, value kind): why it is allowed to fail
DEADLINE_S = 20


def commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def valued_options(command: click.Command) -> list[str]:
    """The command's flags that take a value (not on/off flags, not counts)."""
    return [
        max(p.opts, key=len)
        for p in command.params
        if isinstance(p, click.Option) and not p.is_flag and not p.count and p.opts
    ]


COMMANDS = dict(commands())


def cases(path: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(flag, kind) for flag in valued_options(COMMANDS[path]) for kind in HOSTILE]


def argv(path: tuple[str, ...], flag: str, value: str) -> list[str]:
    base = list(BASE.get(path[-1], []))
    if flag in base:  # the fuzzed value replaces the base's
        at = base.index(flag)
        del base[at : at + 2]
    return [*path, *base, flag, value]


class Deadline(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    def expire(signum, frame):
        raise Deadline(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def run_case(args: list[str]) -> tuple[int | str, str]:
    """`autotune ARGS` through main() in this process: (exit status, stderr), or ('traceback', text)."""
    with CliRunner().isolation() as (out, err, _), mock.patch.object(sys, "argv", ["autotune", *args]):
        try:
            with deadline(DEADLINE_S):
                main()
            code: int | str = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # a bug, or past the deadline: what a user would see as a traceback
            return "traceback", traceback.format_exc()
        stderr = err.getvalue().decode("utf-8", "replace")
    return code, stderr


def problems_of(
    path: tuple[str, ...], flag: str, kind: str, code: int | str, stderr: str, db_changed: bool, left: list[int]
) -> list[str]:
    where = f"{' '.join(path)} {flag} <{kind}>"
    found = []
    if code == "traceback" or "Traceback" in stderr:
        found.append(f"{where}: traceback: {stderr.strip().splitlines()[-1][:300] if stderr.strip() else ''}")
    elif code not in DOCUMENTED_EXITS:
        found.append(f"{where}: exit status {code}: {stderr.strip()[-300:]}")
    elif code == 2:
        lines = stderr.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("autotune: error: "):
            found.append(f"{where}: a refusal is one line 'autotune: error: ...', got {stderr.strip()[:300]!r}")
        if db_changed:
            found.append(f"{where}: refused (exit 2) but the database changed")
    if left:
        found.append(f"{where}: processes left behind: {left}")
    return found


# `node` and `serve` serve forever once their flags are fine: their loops are stand-ins here (what
# each runs after every check).
def _node_stand_in(*args, **kwargs):
    raise SystemExit(0)


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_hostile_values_in_every_flag_end_as_documented(work, hermetic_home, path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the same answers on a machine with a GPU
    db = hermetic_home / "autotune.db"
    found: list[str] = []
    with (
        mock.patch("autotune.probe.node.serve_node", _node_stand_in),
        mock.patch("autotune.service.server.listen", _node_stand_in),
    ):
        for flag, kind in cases(path):
            before = digest(db)
            # Only what this case started: the worker may hold other tests' processes (a session's
            # server), which are neither this case's fault nor its to kill.
            already = set(children())
            code, stderr = run_case(argv(path, flag, HOSTILE[kind]))
            left = [pid for pid in children() if pid not in already]
            for pid in left:  # (so that one leftover does not fail every later case)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            problems = problems_of(path, flag, kind, code, stderr, digest(db) != before, left)
            if problems and (path[-1], flag, kind) in KNOWN_ELSEWHERE:
                warnings.warn(f"known: {problems[0][:200]} ({KNOWN_ELSEWHERE[path[-1], flag, kind]})")
                continue
            found += problems
    assert not found, f"{len(found)} of {len(cases(path))} cases:\n" + "\n".join(found[:40])


def test_every_command_and_flag_is_fuzzed():
    """The table covers what the command line has (a command without BASE arguments has no
    model or study to stop at: say why here before adding one)."""
    total = sum(len(cases(path)) for path in COMMANDS)
    assert set(BASE) <= {path[-1] for path in COMMANDS}
    assert total >= 2500, total  # 222 valued flags x 13 values when written
