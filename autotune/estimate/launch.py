"""Running the trace child: `python -m autotune.estimate.trace`, one process for request after
request, so that torch and transformers are imported once; it may be started ahead of its request
(`TraceChild`), and several may share a request (`TraceChildren`). Failures of a child become
`EstimateError`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any
from pathlib import Path

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import AutotuneError, BadInput
from autotune.host.processes import (
    STARTUP_FLOOR_SECONDS,
    fork_server_context,
    fork_server_current,
    fork_server_fits,
    kill_me_with_parent,
    run_as_child,
    start_forked,
    use_fork_server,
)
from autotune.estimate.protocol import TraceFailure, TraceRequest, TraceResult, read_answer

log = logging.getLogger("autotune")


# The model type whose code a trace child imports while it waits for its request.
PRELOAD_ENV = "AUTOTUNE_TRACE_PRELOAD"


class EstimateError(AutotuneError):
    """The configuration could not be traced (the trace child failed, crashed or timed out)."""


class NativeCrash(EstimateError):
    """The trace child was ended by a native crash (an abort, a segmentation fault). Traced once
    more in a fresh process before it is an error, and said: a crash is a bug to find, not noise.
    (The one seen so far was ours: deep copies of fake tensors copied their FakeTensorMode and
    freed a storage twice, trace.py `_fake_tensors_copied_as_real_ones`.)"""


# Signals of a native crash, as opposed to a kill from outside (SIGKILL: a timeout, close()).
NATIVE_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def _describe(config: ProbeConfig) -> str:
    return f"{config.model} {config.label()}"


class TraceChild:
    """The trace child's process, which may be started before its request is known: it imports
    torch and transformers first and reads its request afterwards, so a search that starts it
    alongside the probe's own child overlaps the two start-ups. It answers request after request
    (a search's later groups, a planner's later traces find it warm) until one fails, which ends it.
    It dies with this process (kill -9 included) and is killed on `close` (TraceChildren's, which
    owns it)."""

    def __init__(self, model_type: str | None = None) -> None:
        self._process: subprocess.Popen[str] | ForkedTrace | None = None
        self._stderr: Any = None
        self._answering = False
        self.model_type = model_type  # (the model whose code a child started on demand imports first)
        self.spawned_in: threading.Thread | None = None  # the thread a spawned process dies with (see start)

    def start(self, model_type: str | None = None, limit: float = STARTUP_FLOOR_SECONDS) -> "TraceChild":
        """Start the process (one already running is kept: it is warm); with `model_type` (or the
        one it was made for), it also imports that model's code while it waits for its request (the
        first trace would import it: seconds on a small host). Forked from a fork server that is not
        ready within `limit` seconds (a command's deadline), it is not started: `answer` starts it
        when it is wanted."""
        if self._process is not None:
            return self
        model_type = model_type or self.model_type
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        # The child must import this very autotune, also when it runs from a checkout.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TRANSFORMERS_VERBOSITY="error",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        if model_type:
            env[PRELOAD_ENV] = model_type
        # Its stderr goes to a file, read when it is done: a chatty child cannot fill a pipe and stall.
        self._stderr = tempfile.TemporaryFile("w+")
        try:
            forked = _forked(env, self._stderr, limit)
        except TimeoutError:
            self._stderr.close()
            self._stderr = None
            return self
        self._process = forked or subprocess.Popen(
            [sys.executable, "-m", "autotune.estimate.trace"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
            preexec_fn=kill_me_with_parent,
        )
        # (a spawned child dies when this thread ends: the parent-death signal follows the thread)
        self.spawned_in = None if forked else threading.current_thread()
        return self

    @property
    def started(self) -> bool:
        return self._process is not None

    def ensure_started(self, timeout: float) -> None:
        """A live process to send a request to: started now if there is none, or a fresh one for one
        that died waiting (a forked one with its fork server, which restarts when the environment
        changes: nothing of a request was lost). EstimateError when it cannot start in `timeout`."""
        if self._process is not None and self._process.poll() is not None:
            self._discard()
        if self._process is None and self.start(limit=timeout)._process is None:
            raise EstimateError(
                f"the estimator's process did not start within {timeout:.0f} s (its fork server was "
                f"still importing torch: an overloaded machine?); it was stopped. Run the command again."
            )

    def answer(
        self, request: TraceRequest, timeout: float, on_result: Callable[[TraceResult], None] | None = None
    ) -> list[TraceResult]:
        """The child's results for every item of `request`, in order; each also given to
        `on_result` as soon as it is read. `timeout` seconds per item: a child silent for longer
        is killed."""
        self.ensure_started(timeout)
        process = self._process
        assert process is not None and process.stdin is not None and process.stdout is not None
        self._answering = True
        results: list[TraceResult] = []
        failure: TraceFailure | None = None
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            process.kill()

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            with contextlib.suppress(BrokenPipeError):  # (a child that died first is reported below)
                process.stdin.write(request.to_json() + "\n")
                process.stdin.flush()
            while len(results) < len(request.items):
                line = process.stdout.readline()
                if not line:  # it died, or was killed at the timeout
                    break
                answer = read_answer(line)
                if isinstance(answer, TraceFailure):
                    failure = answer  # (and it exits)
                    break
                if answer is not None:
                    results.append(answer)
                    timer.cancel()  # the next item has its own `timeout`
                    timer = threading.Timer(timeout, expire)
                    timer.start()
                    if on_result is not None:
                        on_result(answer)
        finally:
            timer.cancel()
            self._answering = False
        if failure is None and len(results) == len(request.items):
            return results  # the process waits, warm, for the next request
        # Spent: the child exits after a failure, and silence means it died (or the timer killed it).
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stderr = self._discard()
        if failure is not None and failure.error_type == "BadInput":
            # Something the user must change that only the model's build could tell (LoRA targets
            # that match no module): one line, as a flag's mistake.
            raise BadInput(failure.message.removeprefix("BadInput: "))
        if failure is not None:
            raise EstimateError(
                f"could not trace {_describe(request.items[failure.index].config)}: {failure.message}; "
                f"probe the configuration instead."
            )
        what = _describe(request.items[len(results)].config)  # the item the child was tracing when it stopped
        if timed_out.is_set():
            raise EstimateError(
                f"estimating {what} took longer than {timeout:.0f} s and was stopped; "
                f"allow more time (--timeout) or probe the configuration instead."
            )
        returncode = process.returncode
        assert returncode is not None  # (the child's output ended with it: it has exited)
        if returncode < 0:
            try:
                how = f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"killed by signal {-returncode}"
        else:
            how = f"exit status {returncode}"
        tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["no message"]
        crashed = returncode < 0 and -returncode in NATIVE_CRASH_SIGNALS
        raise (NativeCrash if crashed else EstimateError)(
            f"the estimator's process died while tracing {what} ({how}: {tail[0][:300]}); probe the configuration instead."
        )

    def _discard(self) -> str:
        """Forget the ended process: close our ends of its pipes; its stderr's text."""
        process, self._process = self._process, None
        assert process is not None and process.stdin is not None and process.stdout is not None
        with contextlib.suppress(OSError):
            process.stdin.close()
        process.stdout.close()
        return self._read_stderr()

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read()
        self._stderr.close()
        self._stderr = None
        return text

    def signal(self, signum: int) -> None:
        """Send `signum` to the process if it is still running (SIGSTOP/SIGCONT: see TraceChildren)."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signum)

    def close(self) -> None:
        """Kill the process; one answering in another thread is reaped there (its answer fails)."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            if not self._answering:
                process.communicate()
                self._read_stderr()


def _forked(env: dict[str, str], stderr: Any, limit: float) -> "ForkedTrace | None":
    """The trace child forked from this process's fork server (autotune.host.processes), which imported
    torch and transformers once for the probe children too, where probes use one (no CUDA here), this
    is the main thread and the server need not start again for it (fork_server_fits); else None (then
    it is spawned: `python -m autotune.estimate.trace`). TimeoutError, the server killed, when the
    server has not forked it within `limit` seconds (autotune.host.processes.start_forked)."""
    from autotune.probe.runner import cuda_may_be_visible

    context = fork_server_context(cuda_possible=cuda_may_be_visible())
    if not use_fork_server(context) or _main_would_run_again() or not fork_server_fits():
        return None
    # Its standard streams: pipes to and from us, and the file for its stderr (passed as
    # multiprocessing's Connections, which carry a file descriptor to the server's child).
    to_child, from_us = os.pipe()
    from_child, to_us = os.pipe()
    streams = (
        Connection(to_child, writable=False),
        Connection(to_us, readable=False),
        Connection(os.dup(stderr.fileno()), readable=False),
    )
    fork_server_current()
    process = context.Process(
        target=run_as_child,
        args=(os.getpid(), "autotune.estimate.trace:serve", *streams),
        kwargs={"forked_for": env},
        name="autotune-trace",
        daemon=True,
    )
    try:
        start_forked(process, limit)
    except TimeoutError:
        for fd in (from_us, from_child):
            os.close(fd)
        raise
    except OSError:  # the server could not start (a TMPDIR too long for its socket's path): spawned
        for fd in (from_us, from_child):
            os.close(fd)
        return None
    finally:
        for stream in streams:  # (the child holds its own copies now)
            stream.close()
    return ForkedTrace(process, open(from_us, "w"), open(from_child, "r"))


def _main_would_run_again() -> bool:
    """Whether a child of multiprocessing's would run this program's main script again as it starts
    (a script given by its path, not `python -m` or `-c`; autotune's own command is guarded): one
    without an `if __name__ == "__main__":` guard that estimates would start the trace again in the
    child. A probe's user must guard (runner.py says so); an estimate's need not: it is spawned."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) or getattr(main, "__file__", None) is None:
        return False
    return os.path.basename(str(getattr(main, "__file__", ""))) != "autotune"


class ForkedTrace:
    """A forked trace child, with the part of subprocess.Popen's interface TraceChild uses."""

    def __init__(self, process: Any, stdin: Any, stdout: Any) -> None:
        self.process, self.stdin, self.stdout = process, stdin, stdout

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # (as Popen's: -N for signal N)

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("autotune.estimate.trace", timeout or 0)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def communicate(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()
        self.stdout.read()
        self.stdout.close()
        self.wait()


class TraceChildren:
    """Trace children that share a request: each traces its share in parallel (traces are
    independent, and on a multi-core host they are the search's longest wait before its first
    probe). Started ahead with `start`, or on demand (a command answered from the estimate cache
    then starts none: each would wait seconds for torch); all are killed on `close`."""

    def __init__(self, count: int = 1, model_type: str | None = None) -> None:
        self.children = [TraceChild(model_type) for _ in range(max(1, count))]

    def start(self, model_type: str | None = None, limit: float = STARTUP_FLOOR_SECONDS) -> "TraceChildren":
        """Start them ahead (TraceChild.start), all within `limit` seconds."""
        until = time.monotonic() + limit
        for child in self.children:
            child.start(model_type, max(0.0, until - time.monotonic()))
        return self

    def answer(
        self, request: TraceRequest, timeout: float, on_result: Callable[[TraceResult], None] | None = None
    ) -> list[TraceResult]:
        """The results for every item of `request`, in order; each also given to `on_result` (one
        call at a time) as soon as it is in. `timeout` seconds per item. Children started ahead are
        used first, so that a small request starts no new process. Each child takes the next item
        as soon as it is free (items given in the order they are wanted arrive about in that order,
        and a long trace, a DDP rank's, does not hold back a share dealt to its child in advance:
        every child is busy until the last items). The first failure, a refusal (BadInput) as much
        as an error, is raised once every child has finished the item it holds; no further item is
        started."""
        ready = sorted(self.children, key=lambda child: not child.started)
        workers = ready[: max(1, min(len(ready), len(request.items)))]
        waiting = collections.deque(range(len(request.items)))
        results: list[TraceResult | None] = [None] * len(request.items)
        failures: list[AutotuneError] = []
        lock = threading.Lock()

        def trace_in_turn(child: TraceChild) -> None:
            crashed = False  # (a native crash is traced once more in a fresh process; a second is an error)
            while True:
                with lock:
                    if failures or not waiting:
                        return
                    index = waiting.popleft()

                def arrived(result: TraceResult, index: int = index) -> None:
                    result = dataclasses.replace(result, index=index)
                    with lock:
                        results[index] = result
                        if on_result is not None:
                            on_result(result)

                try:
                    child.answer(TraceRequest(request.device_type, (request.items[index],)), timeout, arrived)
                except NativeCrash as crash:
                    if not crashed:
                        crashed = True
                        log.warning("%s; tracing it once more in a fresh process", crash)
                        with lock:
                            waiting.appendleft(index)
                        continue
                    with lock:
                        failures.append(crash)
                except AutotuneError as exc:
                    with lock:
                        failures.append(exc)

        if len(workers) == 1:
            trace_in_turn(workers[0])
        else:
            # Each child is started here, not in its thread: a spawned child is killed when the
            # thread that started it ends (kill_me_with_parent: the kernel's parent-death signal follows
            # the thread), which would be as soon as this request is answered.
            for child in workers:
                child.ensure_started(timeout)
            threads = [threading.Thread(target=trace_in_turn, args=(child,), daemon=True) for child in workers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            # A child started again inside its thread (after a native crash) dies as that thread has
            # now ended: closed here, not found dying by the next request; the next one starts in
            # the caller's thread.
            for child in workers:
                if child.started and child.spawned_in in threads:
                    child.close()
        if failures:
            raise failures[0]
        return [result for result in results if result is not None]

    def pause(self) -> None:
        """Stop the children where they are (SIGSTOP), so that a probe's timed window does not share
        the host's cores with them; `resume` lets them go on."""
        for child in self.children:
            child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        for child in self.children:
            child.signal(signal.SIGCONT)

    def close(self) -> None:
        for child in self.children:
            child.close()

    def __enter__(self) -> "TraceChildren":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
