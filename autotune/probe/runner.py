"""The parent side of a probe: start a child process, hand it a configuration, wait with a time
limit, and turn whatever happens (a result, a hang, a dead process) into a ProbeResult.

The parent never imports torch. A child that ended a probe cleanly is kept for the next one when
`reuse_child` is on (the default: it saves the interpreter start and the torch/transformers
imports, several seconds a probe), and so is a CPU child after the accountant's OOM; after a CUDA
OOM or any fault the child exits and the next probe gets a fresh process. On CUDA a standby child
is started while a probe runs (it imports torch on the host's spare cores, touching no GPU), so
that the fresh process after an OOM is ready at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from autotune.vocabulary import errors
from autotune.levers import speed_levers
from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.deadline import NO_DEADLINE, Deadline, DeadlineReached
from autotune.host.environment import Environment
from autotune.specs.models import ModelSpec, resolve_model
from autotune.host.processes import (
    STARTUP_FLOOR_SECONDS,
    fork_server_context,
    fork_server_current,
    kill_group,
    run_as_child,
    start_forked,
    use_fork_server,
)
from autotune.probe.protocol import (
    EnvironmentReply,
    EnvironmentRequest,
    Go,
    ModelCheckReply,
    ModelCheckRequest,
    Phase,
    ProbeRequest,
    Ready,
    Reply,
    ResultReply,
    UserErrorReply,
)
from autotune.probe.settings import ProbeSettings
from autotune.results.probe_result import ProbeResult
from autotune.levers.sharding import check_rendezvous
from autotune.vocabulary.status import ProbeStatus

# A child must be ready (torch and transformers imported) and answer the preflight's questions
# within the probe timeout, and never less than STARTUP_FLOOR_SECONDS (autotune.host.processes).
CHILD_MAIN = "autotune.probe.child:main"


class Neighbours(Protocol):
    """Processes a runner pauses while a probe times its window (see ProbeRunner.neighbours)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ProbeRunner:
    """Runs probes in child processes. Use as a context manager so the child is always stopped."""

    def __init__(
        self, settings: ProbeSettings | None = None, *, reuse_child: bool = True, standby: bool | None = None
    ) -> None:
        self.settings = settings or ProbeSettings()
        self.reuse_child = reuse_child
        # A standby child, started while a probe runs, takes over when the probe leaves its
        # process untrusted. None: on CUDA only (on a CPU device its imports would share the
        # cores the probe is timed on; there a CPU OOM keeps its child anyway).
        self.standby = standby
        # Where no CUDA can be used, children are forked from a server that imported torch once
        # (autotune.host.processes.fork_server_context): seconds saved on each child after the first.
        kind = self.settings.device_kind
        self._ctx = fork_server_context(cuda_possible=kind == "cuda" or (kind == "auto" and cuda_may_be_visible()))
        self._process: Any = None  # multiprocessing's Process (spawned or forked), while a child is alive
        self._conn: Any = None  # our end of the pipe to it
        self._spare: tuple[Any, Any] | None = None  # (process, pipe) of the standby child
        self._device_type: str | None = None  # cpu or cuda, once the child has said
        # The CUDA allocator setting the child (and the standby) were started with: the allocator
        # reads it once, so a config with another setting gets new processes (autotune.levers.speed_levers).
        self._allocator = speed_levers.DEFAULT_ALLOCATOR
        self.children_started = 0
        self.retired: list[str] = []  # why each child that ended after its probe was not reused (hygiene.py)
        # (model fingerprint, task, labels, attentions) that build -> the kernels the model lacks
        self._checked: dict[tuple, dict[str, str]] = {}
        # Called with each phase of the probe in flight ('start-up', 'build', 'warm-up', 'timing').
        self.on_phase: Callable[[str], None] | None = None
        # Other processes of this search that would share the host's cores with a timed window (the
        # estimator's trace children, predicting while the first probes run): paused during it.
        self.neighbours: Neighbours | None = None

    # -- child lifecycle -----------------------------------------------------------------------
    def _spawn(self, *extra: object, limit: float = STARTUP_FLOOR_SECONDS) -> tuple[Any, Any]:
        """Start a child process; it says Ready once its imports are done. (`extra`: arguments
        for CHILD_MAIN after its pipe.) TimeoutError when a fork server's child is not started
        within `limit` seconds (a spawned child starts at once, and imports after)."""
        forked = use_fork_server(self._ctx)
        context = self._ctx if forked else mp.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        kwargs: dict[str, Any] = {"environment": speed_levers.allocator_environment(self._allocator)}
        if forked:
            fork_server_current()
            kwargs["forked_for"] = dict(os.environ)
        # The child dies with this process however it ends (kill -9 included): autotune.host.processes.
        process = context.Process(
            target=run_as_child,
            args=(os.getpid(), CHILD_MAIN, child_conn, *extra),
            kwargs=kwargs,
            name="autotune-probe",
            daemon=True,
        )
        try:
            start_forked(process, limit) if forked else process.start()
        except TimeoutError:
            parent_conn.close()
            child_conn.close()
            raise
        except OSError:
            if not forked:
                raise
            # The fork server could not start: its socket lives under TMPDIR, and a long TMPDIR (a
            # batch job's) is past what a Unix socket's path may be. Children are spawned instead.
            parent_conn.close()
            child_conn.close()
            self._ctx = mp.get_context("spawn")
            return self._spawn(*extra, limit=limit)
        child_conn.close()  # so that the child's death reads as EOF here
        self.children_started += 1
        return process, parent_conn

    def _start_child(self, limit: float) -> float:
        """Make a ready child the current one: the standby if there is one, else a new process.
        Returns the seconds waited for it; TimeoutError (the child killed) past `limit` seconds."""
        started = time.perf_counter()
        spare, self._spare = self._spare, None
        if spare is not None and not spare[0].is_alive():
            _stop(*spare)
            spare = None
        try:
            self._process, self._conn = spare or self._spawn(limit=limit)
            reply = self._receive(max(0.0, limit - (time.perf_counter() - started)))
        except TimeoutError:
            self._kill()
            raise
        if not isinstance(reply, Ready):
            exitcode = self._process.exitcode
            self._retire()
            raise RuntimeError(
                f"the probe child did not start (exit code {exitcode}); a script that calls "
                f"run_probe or ProbeRunner must do so under `if __name__ == '__main__':`, since "
                f"children are spawned and import the main module again"
            )
        return time.perf_counter() - started

    def _keep_spare(self) -> None:
        """Start the standby child if this runner keeps one and has none."""
        device_type = self._device_type or (self.settings.device_kind if self.settings.device_kind != "auto" else None)
        # By default a runner that reuses its child keeps one on CUDA; `standby=True` keeps one
        # even without reuse: each probe in a fresh process, started (imports done) while the last
        # probe ran, as a measurement of the noise between processes wants (benchmarks/gpu_evidence/fresh_probes.py).
        wanted = self.standby if self.standby is not None else (device_type == "cuda" and self.reuse_child)
        if wanted and self._spare is None:
            self._spare = self._spawn()

    def _send(self, request: object) -> None:
        assert self._conn is not None
        self._conn.send(request)

    def _receive(self, timeout: float) -> Reply | None:
        """The child's next reply; None if it died; raises TimeoutError past `timeout`."""
        assert self._conn is not None
        try:
            ready = self._conn.poll(timeout)
            if ready:
                return self._conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return None
        raise TimeoutError  # (outside the try: TimeoutError is an OSError)

    def close(self) -> None:
        """Stop the child (politely, then by force) and the standby (at once: it holds nothing)."""
        if self._spare is not None:
            _stop(*self._spare)
            self._spare = None
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
        if self._process is not None:
            self._process.join(timeout=5)
            # The child leads its own group (autotune.host.processes.lead_own_group): whatever it started
            # and left running (a model's own helper that ignores SIGTERM) goes with it, at once.
            kill_group(self._process.pid)
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def _retire(self) -> None:
        """End the current child (after a probe that leaves it unfit it exits by itself: make sure,
        and reap it), keeping the standby: it is the next probe's process, started already."""
        spare, self._spare = self._spare, None
        self.close()
        self._spare = spare

    def _kill(self) -> int | None:
        """Kill the current child at once, with every process it started (its group); its exit code."""
        if self._process is not None:
            kill_group(self._process.pid)
            if self._process.is_alive():  # (killed before it made its group)
                self._process.kill()
            self._process.join(timeout=10)
        exitcode = self._process.exitcode if self._process is not None else None
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        return exitcode

    def __enter__(self) -> "ProbeRunner":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._kill()  # Ctrl-C twice, SIGTERM or SIGHUP: the probe in flight is abandoned, do not wait on it
        self.close()

    # -- requests ------------------------------------------------------------------------------
    def _use_allocator(self, allocator: str) -> None:
        """Make the next child one started with `allocator`'s setting, on CUDA (a CPU child answers
        any allocator with a skip: it has no CUDA allocator to set)."""
        kind = self._device_type or self.settings.device_kind
        cuda = kind == "cuda" or (kind == "auto" and cuda_may_be_visible())
        if not cuda or allocator == self._allocator:
            return
        self.close()
        self._allocator = allocator

    def _ensure_child(self, limit: float) -> float:
        """Start a child if none is alive; the seconds that took (0 when one was reused)."""
        if self._process is not None and self._process.is_alive():
            return 0.0
        self._kill()
        return self._start_child(limit)

    @property
    def _preflight_limit(self) -> float:
        return max(self.settings.timeout, STARTUP_FLOOR_SECONDS)

    def _ask(self, request: object, what: str, deadline: Deadline) -> Reply | None:
        """Send a preflight question to a ready child and wait for its answer, both within the
        preflight's limit (and the command's deadline); a child that does not answer in time,
        whatever its state (stopped, wedged, swapping), is killed and said so in one line."""
        limit = deadline.bound(self._preflight_limit)
        started = time.perf_counter()
        try:
            self._ensure_child(limit)
            assert self._conn is not None
            self._conn.send(request)
            return self._receive(max(0.0, limit - (time.perf_counter() - started)))
        except TimeoutError:
            self._kill()
            if deadline.expired():
                raise DeadlineReached from None
            raise errors.DeviceError(
                f"the probe's process did not answer within {limit:.0f} s while {what} (stopped, "
                f"wedged, or the machine is overloaded); it was killed. Run the command again "
                f"(a larger --probe-timeout allows more)."
            ) from None

    def environment(self, deadline: Deadline = NO_DEADLINE) -> Environment:
        """The device the probes will run on, as the child sees it."""
        reply = self._ask(EnvironmentRequest(self.settings.device), "describing its device", deadline)
        if reply is None:
            raise RuntimeError("the probe child died while describing its device")
        if isinstance(reply, UserErrorReply):
            raise reply.error
        assert isinstance(reply, EnvironmentReply)
        self._device_type = reply.environment.device_type
        return reply.environment

    def check(
        self, spec: ModelSpec, config: ProbeConfig, attentions: tuple[str, ...], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, str]:
        """Refuse, with a user error, a model the probe cannot build here as `config`'s task with
        these attention kernels (built on the meta device: seconds, no memory). Run before anything
        is stored. Returns the kernels the model's class does not implement, with why (their
        probes are skipped); asked again, answers from memory."""
        spec.check_usable(self.settings.trust_remote_code)
        asked = (spec.fingerprint, config.task, config.num_labels, tuple(attentions))
        if asked in self._checked:
            return self._checked[asked]
        reply = self._ask(
            ModelCheckRequest(spec, config, tuple(attentions), self.settings.device, self.settings.trust_remote_code),
            "building the model on the meta device",
            deadline,
        )
        if reply is None:
            self._kill()
            raise errors.ModelNotFound(
                f"--model {spec.reference}: building it killed the probe's process; check its config.json."
            )
        if isinstance(reply, UserErrorReply):
            raise reply.error
        assert isinstance(reply, ModelCheckReply)
        self._checked[asked] = dict(reply.unsupported)
        return self._checked[asked]

    def run(
        self,
        config: ProbeConfig,
        budget: Budget,
        spec: ModelSpec | None = None,
        deadline: Deadline = NO_DEADLINE,
        timing_only: bool = False,
        fresh_process: bool = False,
    ) -> ProbeResult:
        """Probe `config` of the model `spec` (resolved from `config.model` when not given) against
        `budget` in a child; every outcome comes back as a status. The config is trusted: it was
        checked against the model once, before (check_probe_config, or a search's resolution).

        The probe's timeout is held by the wall clock from when a ready child has the request,
        whatever the child is doing (computing, stopped, wedged); starting a fresh child is held to
        the same limit, and never less than STARTUP_FLOOR_SECONDS (imports take seconds). The
        command's `deadline` holds both: it stops the probe and raises DeadlineReached (what it
        would have measured is unknown, so it is not a result). `timing_only`: another window of a
        config measured before (ProbeRequest.timing_only), for its timing alone. `fresh_process`:
        in a process no earlier probe ran in (the warm child is retired first; on CUDA the standby,
        started while the last probe ran, takes over), so that what differs between processes is
        measured, as the real run, a process of its own, will meet it."""
        spec = spec or resolve_model(config.model)
        if config.ranks > 1:
            return self._run_ranks(config, budget, spec, deadline)
        started = time.perf_counter()
        timed_from = started
        compile_until: float | None = None  # while the child compiles, under --max-compile-seconds

        def left() -> float:
            limit = min(self.settings.timeout - (time.perf_counter() - timed_from), deadline.remaining())
            if compile_until is not None:
                limit = min(limit, compile_until - time.perf_counter())
            return max(0.0, limit)

        if fresh_process and self._process is not None:
            self._retire()
        self._use_allocator(config.allocator)
        if self.on_phase is not None and not (self._process is not None and self._process.is_alive()):
            self.on_phase("start-up")
        request = ProbeRequest(
            config=config,
            model=spec,
            budget=budget,
            settings=self.settings,
            hold_before_timing=self.neighbours is not None,
            timing_only=timing_only,
        )
        startup, paused = 0.0, False
        try:
            startup = self._ensure_child(deadline.bound(self._preflight_limit))
            try:
                self._send(request)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                # The warm child died while idle (killed from outside): not this probe's doing, so a
                # fresh child takes the request.
                self._kill()
                startup += self._start_child(deadline.bound(self._preflight_limit))
                self._send(request)
            timed_from = time.perf_counter()
            self._keep_spare()  # while this probe runs, so that a restart after it costs nothing
            reply = self._receive(left())
            while isinstance(reply, Phase):
                # --max-compile-seconds is held by the wall clock, as the timeout is: a compile past
                # it is stopped there (its child killed), not waited for and then skipped.
                bound = self.settings.max_compile_seconds
                compile_until = time.perf_counter() + bound if reply.name == "compile" and bound is not None else None
                if reply.name == "timing" and request.hold_before_timing:
                    assert self.neighbours is not None
                    self.neighbours.pause()
                    paused = True
                    with contextlib.suppress(OSError):  # (a child dead by now reads as EOF below)
                        self._send(Go())  # the child holds its window until the neighbours are stopped
                if self.on_phase is not None:
                    self.on_phase(reply.name)
                reply = self._receive(left())
        except TimeoutError:
            self._kill()
            if deadline.expired():
                raise DeadlineReached(f"{config.label()} was stopped at the command's deadline") from None
            if compile_until is not None and time.perf_counter() >= compile_until:
                return self._failed(
                    budget,
                    ProbeStatus.SKIPPED,
                    f"torch.compile had not finished within --max-compile-seconds "
                    f"{self.settings.max_compile_seconds:g}; its process was stopped there",
                    started,
                    startup,
                )
            return self._failed(
                budget,
                ProbeStatus.TIMEOUT,
                f"no result within {self.settings.timeout:.0f} s; the probe's process was killed",
                started,
                startup,
            )
        finally:
            if paused:
                self.neighbours.resume()  # type: ignore[union-attr]
        if reply is None:
            exitcode = self._kill()
            how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
            return self._failed(
                budget, ProbeStatus.CRASHED, f"the probe's process died without a result ({how})", started, startup
            )
        if isinstance(reply, UserErrorReply):
            raise reply.error
        assert isinstance(reply, ResultReply)
        result = reply.result
        result.startup_seconds = startup
        result.wall_seconds = time.perf_counter() - started
        result.host_load = host_load()
        if reply.why_not_reused is not None:
            self.retired.append(reply.why_not_reused)
        if not reply.child_goes_on or not self.reuse_child:
            self._retire()
        return result

    def _run_ranks(self, config: ProbeConfig, budget: Budget, spec: ModelSpec, deadline: Deadline) -> ProbeResult:
        """A probe on several ranks: torchrun's processes, not this runner's child (probe/torchrun.py).
        On CUDA the child and the standby are stopped first: their CUDA contexts would sit on the
        ranks' cards. The search's other processes (neighbours) are paused throughout."""
        from autotune.probe.torchrun import run_ranks

        kind = self._device_type or self.settings.device_kind
        if kind == "cuda" or (kind == "auto" and cuda_may_be_visible()):
            self.close()
        request = ProbeRequest(config=config, model=spec, budget=budget, settings=self.settings)
        if self.neighbours is not None:
            self.neighbours.pause()
        try:
            result = run_ranks(
                request,
                deadline,
                on_phase=self.on_phase,
                environment=speed_levers.allocator_environment(config.allocator),
            )
        finally:
            if self.neighbours is not None:
                self.neighbours.resume()
        result.host_load = host_load()
        return result

    @staticmethod
    def _failed(budget: Budget, status: ProbeStatus, why: str, started: float, startup: float) -> ProbeResult:
        return ProbeResult(
            status=status,
            budget_bytes=budget.total_bytes,
            margin_bytes=budget.margin_bytes,
            error=why,
            startup_seconds=startup,
            wall_seconds=time.perf_counter() - started,
        )


def host_load() -> float | None:
    """The host's one-minute load average per core (the probe's own threads included): what a
    probe's timing was measured beside. None where the platform has no load average."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return None


def cuda_may_be_visible() -> bool:
    """Whether `--device auto` may mean CUDA here, told without importing torch in this process
    (an NVIDIA device node, and CUDA_VISIBLE_DEVICES not hiding every GPU)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset") not in ("", "-1") and os.path.exists("/dev/nvidiactl")


def _stop(process: Any, conn: Any) -> None:
    """Kill a child that holds nothing (a standby), with its group, and reap it."""
    kill_group(process.pid)
    if process.is_alive():
        process.kill()
    process.join(timeout=10)
    conn.close()


def check_probe_config(
    config: ProbeConfig, spec: ModelSpec, trust_remote_code: bool = False, budget_bytes: int | None = None
) -> None:
    """What a probe of `config` needs of the model, told from its config.json before any process
    starts: a language model of shapes that train (within `budget_bytes` where given), leave to run
    its own code, lengths within its positions."""
    spec.check_usable(trust_remote_code, budget_bytes=budget_bytes)
    spec.check_block_sizes(config.block_size)
    if config.target_length is not None:
        spec.check_block_sizes(config.target_length, flag="--target-length")


def run_probe(
    config: ProbeConfig, budget: int, device: str | None = None, *, settings: ProbeSettings | None = None
) -> ProbeResult:
    """Probe one configuration in a fresh child process and return what it measured.
    `budget` is in bytes; `device` (auto, cpu, cuda, cuda:N) overrides `settings.device`."""
    settings = settings or ProbeSettings()
    if device is not None:
        settings = replace(settings, device=device)
    spec = resolve_model(config.model)
    check_probe_config(config, spec, settings.trust_remote_code, budget)
    check_rendezvous(config.nodes, settings.rendezvous)
    checked = settings.budget(budget)
    with ProbeRunner(settings, reuse_child=False) as runner:
        return runner.run(config, checked, spec)
