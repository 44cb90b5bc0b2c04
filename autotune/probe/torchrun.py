"""The parent side of a multi-rank probe: start the config's ranks through torchrun
(`python -m torch.distributed.run`, the launcher Trainer and accelerate runs use), wait for them
with the probe's time limit, and make one ProbeResult of theirs.

- The result is the largest rank's peaks (what must fit each card), each rank's peaks beside them
  (`rank_peaks`), and the global throughput: every rank's step moves `micro_batch x grad_accum`
  sequences, the slowest rank's step time is the step's.
- A rank that runs out of memory (or fails in any way) leaves at once and torchrun's agent stops
  the others; the probe is the failing rank's outcome, out of memory before a crash it caused.
- Nothing outlives the probe: the agent dies with autotune (parent-death signal), each rank with
  the agent (rank_main.py), and after any ending the launcher kills whatever rank is still alive
  by the pid it wrote. The probe's timeout and the command's deadline are held by the wall clock.
- On several nodes, the rendezvous is bounded too: the first node's agent hosts it and waits
  `Rendezvous.timeout` for the others; if they do not all arrive, or its port is taken by another
  program, the probe ends with one line saying so (DeviceError), not as the config's outcome.

Torch-free, as the runner is.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autotune.vocabulary import defaults
from autotune.host.deadline import Deadline, DeadlineReached
from autotune.vocabulary.errors import DeviceError
from autotune.probe.protocol import ProbeRequest
from autotune.probe.rank_main import DEVICE_ENV, RUN_DIR_ENV, write_whole
from autotune.host.processes import kill_me_with_parent, remove_when_i_die, signals_held, stop_janitor
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import ProbeStatus

POLL_SECONDS = 0.1
# Which rank's outcome the probe reports when ranks differ: the cause before its consequences (a
# rank out of memory makes the others' collectives fail: they read as crashed).
_CAUSES = (ProbeStatus.OOM, ProbeStatus.UNSTABLE, ProbeStatus.SKIPPED, ProbeStatus.TIMEOUT, ProbeStatus.CRASHED)
# How long the nodes of a run wait for each other at a probe's rendezvous: the first node for the
# others to arrive, each other node to reach the first (a name of this module's, which tests shorten).
RENDEZVOUS_SECONDS = defaults.RENDEZVOUS_SECONDS
# What torchrun's agents say when a rendezvous cannot be held or completed (torch 2.x): the first
# node's store cannot listen; it waited its time and only `joined` of the `expected` nodes came.
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_NOT_ALL_JOINED = re.compile(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+) clients joined")


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where this node's ranks meet the others': one node alone (torchrun's `standalone`), or the
    first node's address and port, where the nodes of a run on several meet, waiting `timeout`
    seconds for each other."""

    nodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None  # host:port of the rendezvous (the first node's), for several nodes
    run_id: str = "autotune"
    timeout: float = RENDEZVOUS_SECONDS

    @property
    def port(self) -> str:
        return str(self.endpoint).rpartition(":")[2]

    def arguments(self) -> list[str]:
        if self.nodes == 1 and self.endpoint is None:
            return ["--standalone"]
        # torchrun's static rendezvous: the node ranks are the ones given (the first node's ranks
        # come first, rank 0 among them, which holds the probe), and the first node hosts the
        # store, always (is_master = node rank 0: it never takes another program on its port for
        # the store; it fails to listen instead). The others are its clients. (c10d's dynamic
        # rendezvous numbers nodes by arrival.) `timeout`: the store's, which bounds the first
        # node's wait for the others and each other node's attempts to connect.
        host = str(self.endpoint).rpartition(":")[0]
        return [
            "--nnodes",
            str(self.nodes),
            "--node-rank",
            str(self.node_rank),
            "--rdzv-backend",
            "static",
            "--master-addr",
            host.strip("[]"),
            "--master-port",
            self.port,
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            f"timeout={math.ceil(self.timeout)}",
        ]

    def problem(self, log: str) -> str | None:
        """What kept the first node's rendezvous from completing, told from its agent's output `log`,
        as one line (None: not a rendezvous problem, or not one this can tell)."""
        if _PORT_TAKEN.search(log):
            return (
                f"the rendezvous port {self.port} is taken on this node by another program (address already in "
                f"use): stop that program, or give every node another --rendezvous port"
                f"{_ephemeral_hint(self.port)}."
            )
        if (joined := _NOT_ALL_JOINED.search(log)) is not None:
            return self.missing(int(joined.group(1)) - 1, f"within {math.ceil(self.timeout)} s")
        return None

    def missing(self, arrived: int | None, when: str) -> str:
        """One line for a rendezvous that `arrived` of the other nodes reached (None: not known)."""
        others = self.nodes - 1
        if arrived == 0:
            names = "node 1" if others == 1 else f"nodes {', '.join(str(n) for n in range(1, others))} and {others}"
            who = f"{names} of {self.nodes} did not reach"
        elif arrived is not None:
            who = f"{others - arrived} of the other {others} nodes did not reach"
        else:
            who = "the other nodes did not all reach"
        rank = "1" if others == 1 else "N"
        where = "the other node" if others == 1 else "each other node"
        return (
            f"{who} the rendezvous at {self.endpoint} {when}: run `autotune node --rendezvous {self.endpoint} "
            f"--nodes {self.nodes} --node-rank {rank}` on {where} (if one runs and still did not arrive, another "
            f"program at that address may have answered it instead)."
        )


def rendezvous_seconds(probe_timeout: float) -> float:
    """The first node's wait for the others in a probe: RENDEZVOUS_SECONDS, and never more than half
    of the probe's timeout (whose wall clock also holds the rendezvous), so that a node missing is
    said as such before the probe would time out."""
    return max(1.0, min(RENDEZVOUS_SECONDS, probe_timeout / 2))


def _ephemeral_hint(port: str) -> str:
    """Where `port` lies in the range the system hands out to programs that ask for any port (their
    listening sockets and outgoing connections), why another program may hold it by chance."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as source:
            low, high = (int(field) for field in source.read().split())
    except (OSError, ValueError):
        return ""
    if port.isdigit() and low <= int(port) <= high:
        return (
            f" ({port} is among the ports {low}-{high} this machine hands out to any program that asks for one; "
            f"one below {low} is taken only by a program that names it)"
        )
    return ""


def torchrun_command(ranks_per_node: int, rendezvous: Rendezvous, module: str, log_dir: str) -> list[str]:
    """The command that starts this node's ranks running `module`. Its agent keeps its per-run
    directory in `log_dir` (without one it makes a torchelastic_* directory in the system's
    temporary directory and leaves it there, one per probe)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks_per_node),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        "--log-dir",
        log_dir,
        *rendezvous.arguments(),
        "-m",
        module,
    ]


def start_ranks(
    module: str,
    ranks_here: int,
    run_dir: str,
    *,
    rendezvous: Rendezvous = Rendezvous(),
    environment: dict[str, str | None] | None = None,
    output: Any = None,
) -> subprocess.Popen:
    """Start torchrun's agent for this node's ranks of `module`, which talk to us through files in
    `run_dir` (RUN_DIR_ENV); `environment` is set (None: unset) for them, their output goes to
    `output` (a file; torchrun.log in `run_dir` when None). The agent dies with this process, and
    each rank with the agent (rank_main.tie_to_agent); `stop_ranks` ends them all."""
    env = {**os.environ, RUN_DIR_ENV: run_dir}
    for name, value in (environment or {}).items():  # (None: unset, as the CUDA allocator's settings need)
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    # (torchrun sets one OpenMP thread per rank where several share a host, unless told otherwise)
    with contextlib.ExitStack() as files:
        if output is None:
            output = files.enter_context(open(os.path.join(run_dir, "torchrun.log"), "wb"))
        command = torchrun_command(ranks_here, rendezvous, module, log_dir=os.path.join(run_dir, "torchelastic"))
        return subprocess.Popen(
            command,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=kill_me_with_parent,
            start_new_session=True,
        )


class RanksOutput(threading.Thread):
    """The ranks' output relayed to `to` (a text stream) as it comes, less torchrun's own: its
    OpenMP banner, and once a rank has failed, the agent's report of it (an `E... torch/distributed/
    elastic` log line, then a 40-line traceback of ChildFailedError): the ranks have said what went
    wrong above it, and the caller says how the run ended."""

    def __init__(self, source: Any, to: Any) -> None:
        super().__init__(name="autotune-ranks-output", daemon=True)
        self.source, self.to = source, to

    def run(self) -> None:
        reporting = False
        for raw in iter(self.source.readline, b""):
            line = raw.decode(errors="replace")
            reporting = reporting or "torch/distributed/elastic/" in line or "ChildFailedError" in line
            if reporting or line.startswith("*****") or line.startswith("Setting OMP_NUM_THREADS"):
                continue
            with contextlib.suppress(OSError, ValueError):
                self.to.write(line)
                self.to.flush()
        self.source.close()


class RankLaunch:
    """A run directory (made as its `with` begins) and the torchrun agent started on it. However its
    `with` ends (a result, a timeout, Ctrl-C, an error), every rank is stopped and the directory
    removed on the way out, a signal at any instant included (signals_held); where this process is
    killed with -9, the agent and ranks die with it and a janitor removes the directory."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.run_dir = ""
        self.agent: subprocess.Popen | None = None
        self.relay: RanksOutput | None = None
        self.janitor: Any = None

    def write(self, name: str, data: bytes) -> None:
        write_whole(os.path.join(self.run_dir, name), data)

    def start(self, module: str, ranks_here: int, *, relay_to: Any = None, **kwargs: Any) -> subprocess.Popen:
        """Start the agent; `relay_to`: a text stream the ranks' output goes to as it comes (RanksOutput)."""
        if relay_to is not None:
            kwargs["output"] = subprocess.PIPE
        with signals_held():  # (a Ctrl-C or SIGTERM comes once self.agent holds the agent: stop() ends it)
            self.agent = start_ranks(module, ranks_here, self.run_dir, **kwargs)
        if relay_to is not None:
            self.relay = RanksOutput(self.agent.stdout, relay_to)
            self.relay.start()
        return self.agent

    def stop(self) -> None:
        """Stop the agent and every rank still alive (none left once the agent has ended them)."""
        if self.agent is not None:
            stop_ranks(self.agent, self.run_dir)
        if self.relay is not None:
            self.relay.join(timeout=5)  # (the pipe closes with the last rank)

    def __enter__(self) -> "RankLaunch":
        # A Ctrl-C or SIGTERM held while the directory is made arrives as the hold ends: here, where
        # the `with` does not own the directory yet (__exit__ is not called when __enter__ raises).
        try:
            with signals_held():
                self.run_dir = tempfile.mkdtemp(prefix=self.prefix)
                self.janitor = remove_when_i_die(self.run_dir)
        except BaseException:
            if self.run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            stop_janitor(self.janitor)
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            with signals_held():  # (a second Ctrl-C does not leave it half removed)
                shutil.rmtree(self.run_dir, ignore_errors=True)
                stop_janitor(self.janitor)


def run_ranks(
    request: ProbeRequest,
    deadline: Deadline,
    *,
    on_phase: Callable[[str], None] | None = None,
    environment: dict[str, str | None] | None = None,
) -> ProbeResult:
    """Probe `request.config` on its ranks: `gpus` on this node, and as many on each of its other
    `nodes` (`autotune node`, meeting at `settings.rendezvous`); `environment` is set (None:
    unset) for this node's ranks. Every outcome comes back as a status, and a user error as
    AutotuneError: DeviceError when the nodes did not meet (Rendezvous.problem). Raises
    DeadlineReached at the command's deadline (the ranks killed first)."""
    config, settings = request.config, request.settings
    rendezvous = (
        Rendezvous(config.nodes, 0, settings.rendezvous, timeout=rendezvous_seconds(settings.timeout))
        if config.nodes > 1
        else Rendezvous()
    )
    started = time.perf_counter()
    with RankLaunch("autotune-ranks-") as launch:
        run_dir = launch.run_dir
        launch.write("request.pickle", pickle.dumps(replace(request, hold_before_timing=False)))
        agent = launch.start(
            "autotune.probe.rank_main",
            config.gpus,
            rendezvous=rendezvous,
            environment={**(environment or {}), DEVICE_ENV: settings.device_kind},
        )
        if on_phase is not None:
            on_phase("start-up")
        limit = started + settings.timeout
        phase = ""
        while agent.poll() is None:
            if deadline.expired():
                raise DeadlineReached(f"{config.label()} was stopped at the command's deadline")
            if time.perf_counter() > limit:
                if config.nodes > 1 and not ranks_started(run_dir):  # (the nodes never met: not the config's doing)
                    raise DeviceError(rendezvous.missing(None, f"within the probe's {settings.timeout:.0f} s"))
                return _failed(
                    request,
                    ProbeStatus.TIMEOUT,
                    f"no result from {config.ranks} ranks within {settings.timeout:.0f} s; every rank was killed",
                    started,
                )
            now = _read(os.path.join(run_dir, "phase"))
            if now and now != phase and on_phase is not None:
                on_phase(now)
            phase = now or phase
            time.sleep(POLL_SECONDS)
        launch.stop()  # (ranks the agent left: none, unless it was killed)
        problem = rendezvous.problem(_read(os.path.join(run_dir, "torchrun.log"))) if config.nodes > 1 else None
        if problem is not None and not ranks_started(run_dir):  # (the nodes never met: not the config's doing)
            raise DeviceError(problem)
        return _gather(request, run_dir, config.ranks, agent.returncode, started)


def ranks_started(run_dir: str) -> bool:
    """Whether any of this node's ranks has started (torchrun starts them once its rendezvous is
    complete; each writes its pid first)."""
    return any(name.startswith("rank-") and name.endswith(".pid") for name in os.listdir(run_dir))


def _gather(request: ProbeRequest, run_dir: str, ranks: int, returncode: int, started: float) -> ProbeResult:
    """One result of the ranks' results, or a user error one of them raised."""
    results: list[ProbeResult | None] = []
    for rank in range(ranks):
        error = os.path.join(run_dir, f"rank-{rank}.error")
        if os.path.exists(error):
            with open(error, "rb") as source:
                raise pickle.load(source)
        path = os.path.join(run_dir, f"rank-{rank}.result")
        if os.path.exists(path):
            with open(path, "rb") as source:
                results.append(pickle.load(source))
        else:
            results.append(None)
    known = [result for result in results if result is not None]
    if not known:
        return _failed(
            request,
            ProbeStatus.CRASHED,
            f"torchrun ended (exit code {returncode}) with no rank's result: {_log_tail(run_dir)}",
            started,
        )
    reported = next((result for status in _CAUSES for result in known if result.status == status), known[0])
    if reported.status not in _CAUSES[:-1] and len(known) < ranks:
        # A rank died without a word (a signal, the host's OOM killer): the others' failing
        # collectives are its consequence; what it printed is the cause.
        dead = [rank for rank, result in enumerate(results) if result is None]
        reported = replace(
            reported,
            status=ProbeStatus.CRASHED,
            error=f"rank {dead[0]} of {ranks} died without a "
            f"result (torchrun's exit code {returncode}): {_log_tail(run_dir)}",
        )
    merged = replace(reported)
    peaks = [
        {"allocated": r.peak_allocated_bytes, "reserved": r.peak_reserved_bytes} if r is not None else None
        for r in results
    ]
    merged.rank_peaks = peaks  # type: ignore[assignment]
    if all(r is not None and r.peak_reserved_bytes is not None for r in results):
        merged.peak_allocated_bytes = max(r.peak_allocated_bytes or 0 for r in known)
        merged.peak_reserved_bytes = max(r.peak_reserved_bytes or 0 for r in known)
    if merged.status == ProbeStatus.OK:
        slowest = max(known, key=lambda r: r.step_seconds or 0.0)
        merged.step_seconds, merged.step_spread, merged.step_times = (
            slowest.step_seconds,
            slowest.step_spread,
            slowest.step_times,
        )
        assert slowest.step_seconds
        merged.tokens_per_s = request.config.tokens_per_step / slowest.step_seconds
        merged.samples_per_s = request.config.effective_batch / slowest.step_seconds
    elif (which := next((rank for rank, r in enumerate(results) if r is reported), None)) is not None:
        merged.error = f"rank {which} of {ranks}: {reported.error}"
    merged.wall_seconds = time.perf_counter() - started
    return merged


def stop_ranks(agent: subprocess.Popen, run_dir: str) -> None:
    """Kill the agent (if alive) and any rank still alive, by the pids they wrote; reap the agent."""
    if agent.poll() is None:
        agent.kill()
        agent.wait(timeout=10)
    for name in os.listdir(run_dir):
        if name.startswith("rank-") and name.endswith(".pid"):
            pid = _read(os.path.join(run_dir, name))
            if pid.isdigit() and _is_rank(int(pid)):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # gone (or the pid reused by someone else's process: not ours to kill)


def _is_rank(pid: int) -> bool:
    """Whether `pid` is still a probe rank (not a process that took the pid of one that ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as source:
            command = source.read()
        return b"autotune.probe.rank_main" in command or b"autotune.train.rank_main" in command
    except OSError:
        return sys.platform != "linux"  # (elsewhere the pid is all there is to go by)


def _read(path: str) -> str:
    try:
        with open(path) as source:
            return source.read().strip()
    except OSError:
        return ""


def _log_tail(run_dir: str, chars: int = 600) -> str:
    text = _read(os.path.join(run_dir, "torchrun.log"))
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(("W", "*"))]
    return " | ".join(lines)[-chars:] or "(torchrun printed nothing)"


def _failed(request: ProbeRequest, status: ProbeStatus, why: str, started: float) -> ProbeResult:
    return ProbeResult(
        status=status,
        budget_bytes=request.budget.total_bytes,
        margin_bytes=request.budget.margin_bytes,
        error=why,
        wall_seconds=time.perf_counter() - started,
    )
