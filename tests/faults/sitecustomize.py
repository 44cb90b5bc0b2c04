"""Fault injection for tests, kept out of production code.

A test that wants a probe to misbehave puts this directory first on PYTHONPATH and names a fault
in AUTOTUNE_INJECT_FAULT (see tests/faults/__init__.py: `fault_env`). Python runs this file at
start-up in every process of the test, the spawned probe children included; it waits for
`autotune.probe.step` to be imported and then wraps `ProbeStep.__call__`, so that the real child,
runner and search handle a real hang, SIGKILL, exception or non-finite loss.

The fault fires on the third step, the first of the timed window after the two warm-up steps (the
estimator traces only two steps, so its estimates are untouched).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

FAULT = os.environ.get("AUTOTUNE_INJECT_FAULT")
TARGET = "autotune.probe.step"
FIRES_ON_STEP = 3


def _install(module) -> None:
    original = module.ProbeStep.__call__
    calls = {"n": 0}

    def faulty_call(self):
        calls["n"] += 1
        if calls["n"] < FIRES_ON_STEP:
            return original(self)
        if FAULT == "hang":
            time.sleep(10**6)
        if FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if FAULT == "error":
            raise RuntimeError("injected failure (test fault)")
        if FAULT == "nan":
            original(self)
            return float("nan")
        return original(self)

    module.ProbeStep.__call__ = faulty_call


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module the normal way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _install(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if FAULT:
    sys.meta_path.insert(0, _PatchAfterImport())
