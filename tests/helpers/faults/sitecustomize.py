"""Fault injection for tests, kept out of production code.

A test that wants a probe to misbehave puts this directory first on PYTHONPATH (tests/conftest.py
does, for every process of the test run) and names a fault in AUTOTUNE_INJECT_FAULT (see
tests/helpers/faults/__init__.py: `fault_env`). Python runs this file at start-up in every process
of the test, the probe children included; it waits for `autotune.probe.step` to be imported and
then, where a fault is named then, wraps `ProbeStep.__call__`, so that the real child, runner and
search handle a real hang, SIGKILL, exception or non-finite loss.

The fault fires on the third step, the first of the timed window after the two warm-up steps (the
estimator traces only two steps, so its estimates are untouched), of every probe, or only of the
Nth probe a child runs when AUTOTUNE_INJECT_FAULT_ON_PROBE=N (a warm child runs several).

Three faults leave the probe's process unfit for the next probe rather than failing the probe
(autotune/probe/hygiene.py): `patch-module` replaces a function in GPT-2's modeling module, as Liger
does in Llama's; `leak` keeps a tensor alive in a global (on the first warm-up step, while the CPU
accountant watches); `poison` fails the step as an illegal memory access does and makes the
probe's cleanup raise again, as every CUDA call does after one.

`gate` holds each probe (or only the Nth a child runs, as above) at its first warm-up step (before
anything is timed) until the file named by AUTOTUNE_INJECT_FAULT_GATE exists: a test lets probes go
once the workers it wants are all holding one, or cancels a search while it holds, whatever the
machine's load.

`abort-once` aborts the process (SIGABRT, as glibc does on a corrupted heap) at its first step,
the first time any process of the test gets there (the file AUTOTUNE_INJECT_FAULT_GATE is made then):
a native crash that the same work does not repeat.

`stuck-start` holds every process's import of torch (a probe child's, its fork server's) until
the file AUTOTUNE_INJECT_FAULT_GATE exists: a probe process that cannot finish starting (a hung
filesystem, a swapping host), however fast the machine.

`slow` makes every step from the third on take at least SLOW_STEP_SECONDS, sleeping: a timed window
of N steps lasts N tenths of a second on any machine, without taking a core.

`paced` makes every step last a set time, sleeping, so that which config is fastest is known
whatever the machine's load: PACE_MICRO_STEP_SECONDS + PACE_SAMPLE_SECONDS x micro-batch per
micro-step (effective batch 4: mb4x1 0.10 s a step, mb2x2 0.14 s, mb1x4 0.22 s). The probe
processes of a test are numbered as each begins its first probe (files made in the directory
AUTOTUNE_INJECT_FAULT_GATE), and AUTOTUNE_INJECT_FAULT_SLOW = "PROCESSES:MICRO_BATCH:FACTOR" slows
some of them, as a card runs some processes slower than others: in the processes named ("1", or
"even"), every step of that micro-batch ("*": of every config) runs at FACTOR of its speed.

`oom-on-rank-1` makes rank 1 of a multi-rank probe (and no other) allocate past its budget in its
second warm-up step, while the CPU accountant watches: a real out-of-memory on one rank, raised
by the accountant, while rank 0 goes on into the step's collectives.
`AUTOTUNE_TEST_STACKS` (a directory; no fault needed) makes every Python process of the test write
the stacks of all its threads to DIR/stack-PID.txt on SIGUSR2 (faulthandler): what a test reads
when processes it started do not do in time what they should (tests/launchers/test_ray.py).
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.util
import os
import signal
import sys
import time

TARGET = "autotune.probe.step"
FIRES_ON_STEP = 3
LEAK_BYTES = 4 << 20
LARGER_THAN_ANY_TEST_BUDGET = 3 << 30
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered (test fault)"
_LEAKED: list = []
GATE_SECONDS = 600
SLOW_STEP_SECONDS = 0.1
PACE_MICRO_STEP_SECONDS = 0.04
PACE_SAMPLE_SECONDS = 0.015
_PROCESS_NUMBER: list[int] = []  # this process's, once it begins its first probe (`paced`)


def _process_number(directory: str) -> int:
    """This process's number among the test's probe processes, in the order they first probe."""
    if not _PROCESS_NUMBER:
        number = 1
        while True:
            try:
                os.close(os.open(os.path.join(directory, f"process-{number}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                number += 1
        _PROCESS_NUMBER.append(number)
    return _PROCESS_NUMBER[0]


def _pace(config) -> float:
    """The seconds a `paced` step of `config` lasts in this process."""
    seconds = (PACE_MICRO_STEP_SECONDS + PACE_SAMPLE_SECONDS * config.micro_batch) * config.grad_accum
    processes, micro_batch, factor = (os.environ.get("AUTOTUNE_INJECT_FAULT_SLOW") or "0:*:1").split(":")
    number = _PROCESS_NUMBER[0]
    slowed = number % 2 == 0 if processes == "even" else number == int(processes)
    if slowed and micro_batch in ("*", str(config.micro_batch)):
        seconds /= float(factor)
    return seconds


def _install(module) -> None:
    # (Read when the probe's step module is imported, not when Python starts: a probe child forked
    # from a server started earlier gets the environment of its test then.)
    fault = os.environ.get("AUTOTUNE_INJECT_FAULT")
    on_probe = int(os.environ.get("AUTOTUNE_INJECT_FAULT_ON_PROBE", "0"))  # 0: every probe
    gate = os.environ.get("AUTOTUNE_INJECT_FAULT_GATE")
    if not fault:
        return
    original_init, original = module.ProbeStep.__init__, module.ProbeStep.__call__
    count = {"probes": 0}

    def counting_init(self, *args, **kwargs):
        count["probes"] += 1
        self._fault_probe, self._fault_steps = count["probes"], 0
        if fault == "paced" and gate:
            _process_number(gate)
        original_init(self, *args, **kwargs)

    def faulty_call(self):
        self._fault_steps += 1
        if fault == "abort-once" and self._fault_steps == 1 and gate and not os.path.exists(gate):
            open(gate, "w").close()
            os.abort()
        if fault == "gate" and self._fault_steps == 1 and gate and (not on_probe or self._fault_probe == on_probe):
            deadline = time.monotonic() + GATE_SECONDS
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.1)
        if fault == "leak" and self._fault_steps == 1 and (not on_probe or self._fault_probe == on_probe):
            import torch

            _LEAKED.append(torch.ones(LEAK_BYTES, dtype=torch.uint8))
        if fault == "paced":
            started = time.monotonic()
            loss = original(self)
            time.sleep(max(0.0, _pace(self.config) - (time.monotonic() - started)))
            return loss
        if fault == "oom-on-rank-1" and self._fault_steps == 2 and os.environ.get("RANK") == "1":
            import torch

            torch.empty(LARGER_THAN_ANY_TEST_BUDGET, dtype=torch.uint8)  # (virtual memory: never touched)
        if self._fault_steps < FIRES_ON_STEP or (on_probe and self._fault_probe != on_probe):
            return original(self)
        if fault == "hang":
            time.sleep(10**6)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "error":
            raise RuntimeError("injected failure (test fault)")
        if fault == "patch-module":
            gpt2 = sys.modules["transformers.models.gpt2.modeling_gpt2"]
            original_attention = gpt2.eager_attention_forward
            gpt2.eager_attention_forward = lambda *a, **kw: original_attention(*a, **kw)
        if fault == "poison":

            def release_again(cap):
                raise RuntimeError(ILLEGAL_ACCESS + " (raised again by the cleanup)")

            sys.modules["autotune.probe.cap"].MemoryCap.release = release_again
            raise RuntimeError(ILLEGAL_ACCESS)
        if fault == "slow":
            started = time.monotonic()
            loss = original(self)
            time.sleep(max(0.0, SLOW_STEP_SECONDS - (time.monotonic() - started)))
            return loss
        if fault == "nan":
            original(self)
            return float("nan")
        return original(self)

    module.ProbeStep.__init__ = counting_init
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


class _HoldTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        gate = os.environ.get("AUTOTUNE_INJECT_FAULT_GATE")
        if os.environ.get("AUTOTUNE_INJECT_FAULT") == "stuck-start" and gate:
            deadline = time.monotonic() + GATE_SECONDS
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.1)
        return None  # (then found the normal way)


if TARGET not in sys.modules:
    sys.meta_path.insert(0, _PatchAfterImport())
if "torch" not in sys.modules:
    sys.meta_path.insert(0, _HoldTorchImport())


STACKS_ENV = "AUTOTUNE_TEST_STACKS"  # (also named in __init__.py: this file cannot import its package)


def _stacks_on_sigusr2() -> None:
    """faulthandler's dump of every thread on SIGUSR2, into DIR/stack-PID.txt (this process's own
    file: registered again in each forked child)."""
    directory = os.environ.get(STACKS_ENV)
    if not directory or not os.path.isdir(directory):
        return
    stacks = open(os.path.join(directory, f"stack-{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    _STACK_FILES[:] = [stacks]


_STACK_FILES: list = []
if os.environ.get(STACKS_ENV):
    _stacks_on_sigusr2()
    os.register_at_fork(after_in_child=_stacks_on_sigusr2)
