"""One warm probe child per test worker, shared by the modules whose tests only need a probe run.

A probe child costs seconds to start here (torch and transformers imported); two dozen modules each
started their own. The product already runs many probes in one warm child (ProbeRunner's
`reuse_child`, hygiene.py retiring a child a probe left unfit), so sharing one across modules
exercises the path a search takes. Tests that are about the child's life itself (how many were
started, the standby, faults injected through the environment it was spawned with) keep their own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

from autotune.probe import ProbeRunner, ProbeSettings


class RunnerView:
    """The shared ProbeRunner, seen with these settings: every use of it (by the test, or by the
    search it is handed to) sets the runner's settings to these first. Settings travel with each
    request to the child, so views with different settings share one child."""

    def __init__(self, runner: ProbeRunner, settings: ProbeSettings) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "settings", settings)
        # What an earlier user left set (a search resets both when it ends; a failed test may not).
        runner.on_phase = None
        runner.neighbours = None

    def __getattr__(self, name: str) -> Any:
        runner = object.__getattribute__(self, "_runner")
        runner.settings = object.__getattribute__(self, "settings")
        return getattr(runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "settings":
            object.__setattr__(self, name, value)
        else:
            setattr(self._runner, name, value)

    # As a search uses a runner it made (`with ProbeRunner(settings) as runner`): the shared runner
    # outlives the search.
    def __enter__(self) -> RunnerView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def close(self) -> None:
        """Nothing: a user's close (a benchmark phase's) leaves the shared runner for the next."""


class SharedRunner:
    """The test worker's probe runner (the `probe_runner` fixture): `probe_runner(settings)` is a
    view of it with those settings. Its child starts at the first probe and ends with the session."""

    def __init__(self) -> None:
        self._runner = ProbeRunner(ProbeSettings(device="cpu"))

    def __call__(self, settings: ProbeSettings) -> RunnerView:
        return RunnerView(self._runner, settings)

    def close(self) -> None:
        self._runner.close()


@contextlib.contextmanager
def commands_probe_with(shared: SharedRunner) -> Iterator[None]:
    """The commands run in this process within the block (`invoke`: `search`, `probe`) probe with
    the test worker's warm child: the command's own code, its refusals included, without a new
    child's seconds of imports (the `warm_child` fixture, and module fixtures that run commands).
    What a command writes into this process's environment ends with the block (tests/conftest.py:
    _environment_restored, which a module's fixture runs outside of)."""

    def warm(settings: ProbeSettings | None = None, **_: Any) -> RunnerView:
        return shared(settings or ProbeSettings())

    with (
        mock.patch.dict(os.environ),
        mock.patch("autotune.probe.ProbeRunner", warm),
        mock.patch("autotune.probe.runner.ProbeRunner", warm),
    ):
        yield  # (a search looks the class up in autotune.probe; run_probe, `autotune probe`, in its module)
