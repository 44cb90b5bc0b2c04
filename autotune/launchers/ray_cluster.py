"""`--launcher ray`: one Ray task per worker, where the cluster places it. Each task runs `autotune
worker --study S` in a child process (which dies with the task: the parent-death signal) and asks
Ray for what its probes need: `num_gpus` = the study's ranks (Ray sets CUDA_VISIBLE_DEVICES), and a
STRICT_PACK placement group for a worker of several ranks, so that they share a node. Tasks are
never retried by Ray (`max_retries=0`): an OOM is a result, and a worker that dies is already handled
by the study's heartbeats (another worker takes its configuration over).

Ray starts its task workers at niceness 15 (its `worker_niceness`), and a process inherits its
parent's: each worker is put back at the search's own niceness (0 as a rule) where the node allows
it, so that its probes are not timed, nor its SIGTERM handled, at the priority of background work.
Where it does not (an unprivileged user may not raise a priority), start the cluster with
RAY_worker_niceness=0 in `ray start`'s environment.

A cluster that is not there, or has no node that can hold a worker, is said in one line before
anything is written. Stopping cancels every task (the task sees it within CANCEL_CHECK_SECONDS and
stops its worker as SIGTERM does: the claim given back; run_worker says how), then force-cancels
what is left after the grace.

ray.init takes SIGTERM from the process that calls it (`_sigterm_kept` says how): the search gives
it back at once, so that SIGTERM stops a search on Ray as it stops any other (autotune's one line,
exit status 143), whenever it comes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autotune.vocabulary.errors import BadInput
from autotune.launchers.base import Launcher, WorkerEnd, WorkerSpec

# How long a worker that cannot be placed is waited for before the search says so and stops.
PLACEMENT_SECONDS = 60.0
CONNECT_SECONDS = 5.0
# How often a task's body looks for ray.cancel while its worker runs.
CANCEL_CHECK_SECONDS = 0.5
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def _cancel_flag() -> Callable[[], bool] | None:
    """This task's cancellation flag, which ray.cancel sets whatever the process does with SIGINT;
    None on Ray releases that lack it (added in late 2025, ray-project/ray#58914)."""
    import ray

    return getattr(ray.get_runtime_context(), "is_canceled", None)


@contextlib.contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    """`handler` for SIGINT while this task runs, put back after (Ray's worker process runs later
    tasks). Signals are the main thread's: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Around ray.init: this process's SIGTERM handler as it was before it, and a SIGTERM sent
    meanwhile handled by it, just after.

    ray.init takes SIGTERM twice over: it sets Python's handler to its own (`sys.exit(15)`: a
    SystemExit wherever the signal lands, exit status 15, no line of autotune's; and, once the
    search's watch has put back what it found, a stop of the workers cut short), then its C++ core
    installs a failure signal handler in front of it at the C level, which prints "*** SIGTERM
    received at time=..." and a stack dump before passing the signal on. A search SIGTERMed
    anywhere between ray.init and its watch printed that dump and exited 15. signal.signal puts
    Python's own C handler back with the handler; SIGTERM is blocked in this thread meanwhile (the
    threads ray.init starts keep it blocked, so that it comes to this one), so that one sent during
    ray.init arrives, to autotune's handler, when it is unblocked. (SIGINT and SIGHUP Ray leaves
    alone.) Signals are the main thread's: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        try:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # (one that came meanwhile is handled here)


def run_worker(command: list[str], environment: dict[str, str], niceness: int = 0) -> dict[str, Any]:
    """A Ray task's body: the worker in a child process at `niceness` where the node allows it (the
    module's docstring), to its end, or until the task is cancelled: then SIGTERM, as a search's own
    workers are stopped.

    ray.cancel(force=False) both sets the task's cancellation flag and interrupts the task as
    Ctrl-C would (`_thread.interrupt_main`). The flag, read between slices of the wait, is the stop
    where Ray has one: the interrupt is lost where SIGINT is ignored (every process of a cluster
    started from a script's background job, `ray start ... &` or nohup, inherits that), and where it
    is not it lands wherever the task happens to be (inside Popen, say). So SIGINT is ignored while
    the body runs. Where Ray has no flag, Python's Ctrl-C handler is installed instead and the
    interrupt is the stop (the cluster's workers were killed at the end of the stop's grace
    otherwise, their probes' claims left to go stale)."""
    import subprocess
    import sys

    import ray

    from autotune.host.processes import kill_me_with_parent

    def prepare_child() -> None:
        kill_me_with_parent()
        try:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
        except OSError:  # (not allowed here: the worker keeps Ray's niceness)
            pass

    def stop(child: subprocess.Popen) -> tuple[str, str]:
        child.terminate()
        try:
            return child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.communicate()

    cancelled = _cancel_flag()
    with _sigint(signal.SIG_IGN if cancelled is not None else signal.default_int_handler):
        # (This node's Python, where the driver's path may not exist.)
        child = subprocess.Popen(
            [sys.executable, *command[1:]],
            env={**os.environ, **environment},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            preexec_fn=prepare_child,
        )
        while True:
            # In slices: the flag is read, and an interrupt raised, only between them (an interrupt
            # is not raised inside a wait with no end). Retrying loses no output.
            try:
                out, err = child.communicate(timeout=CANCEL_CHECK_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if cancelled is not None and cancelled():
                    out, err = stop(child)
                    break
            except KeyboardInterrupt:  # (Ray without the flag)
                out, err = stop(child)
                break
    return {
        "code": child.returncode,
        "stdout": out,
        "stderr": err[-4000:],
        "pid": child.pid,
        "host": socket.gethostname(),
        "node": ray.get_runtime_context().get_node_id(),
    }


def ray_address(address: str | None) -> str:
    """The cluster to use: --ray-address, else $RAY_ADDRESS, else the one `ray start` left running
    on this machine; refused in one line where none answers (ray.init would wait minutes)."""
    given = address or os.environ.get("RAY_ADDRESS")
    if not given or given == "auto":
        try:
            given = RAY_CURRENT_CLUSTER.read_text().strip()
        except OSError:
            raise BadInput(
                "--launcher ray: no Ray cluster is running on this machine; give --ray-address HOST:PORT "
                "(the head's, as `ray start --head` printed it), or start one."
            ) from None
    if given.startswith("ray://"):
        raise BadInput(
            f"--ray-address {given}: that is a Ray Client address; the workers are started from a driver on "
            f"the cluster's network: give the head's HOST:PORT as `ray start --head` printed it (e.g. "
            f"10.0.0.1:6379), from a machine of the cluster."
        )
    host, _, port = given.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"--ray-address {given!r}: give the head's HOST:PORT (e.g. 10.0.0.1:6379).")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS) as connection:
            grpc = _speaks_grpc(connection)
    except OSError as exc:
        raise BadInput(
            f"--ray-address {given}: no Ray cluster answers there ({exc.strerror or exc}); start one "
            f"(ray start --head) or give the head's address."
        ) from None
    if not grpc:
        # ray.init would wait there for minutes: the dashboard's 8265 and the client server's 10001
        # answer TCP too.
        raise BadInput(
            f"--ray-address {given}: something answers there, but not a Ray head (its GCS speaks gRPC); the "
            f"head's address is the one `ray start --head` printed (port 6379 by default; 8265 is the dashboard)."
        )
    return given


# HTTP/2's connection preface and an empty SETTINGS frame: a gRPC server (a Ray head's GCS) answers
# with its own SETTINGS frame at once; an HTTP/1 server (the dashboard) or anything else does not.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x04


def _speaks_grpc(connection: socket.socket) -> bool:
    try:
        connection.settimeout(CONNECT_SECONDS)
        connection.sendall(_HTTP2_PREFACE)
        header = b""
        while len(header) < 9:
            chunk = connection.recv(9 - len(header))
            if not chunk:
                return False
            header += chunk
    except OSError:
        return False
    return header[3] == _SETTINGS


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, address: str | None = None) -> None:
        self.address = address
        self.refs: list[Any] = []
        self.groups: list[Any] = []
        self.results: dict[int, dict[str, Any]] = {}

    def check(self, count: int, spec: WorkerSpec) -> None:
        try:
            import ray
        except ImportError:
            raise BadInput(
                "--launcher ray needs Ray on this machine and the cluster's: pip install 'autotune[ray]'."
            ) from None
        address = ray_address(self.address)
        if not ray.is_initialized():
            with _sigterm_kept():
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR, configure_logging=False)
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if spec.device == "cuda":
            most = max((int(node["Resources"].get("GPU", 0)) for node in nodes), default=0)
            if most < spec.ranks:
                raise BadInput(
                    f"--launcher ray: no node of the cluster at {address} has {spec.ranks} GPU"
                    f"{'s' if spec.ranks != 1 else ''} (the most is {most}); each worker's probes need its "
                    f"ranks on one node. Search with fewer --gpus, or --device cpu."
                )
        elif not any(node["Resources"].get("CPU", 0) >= 1 for node in nodes):
            raise BadInput(f"--launcher ray: the cluster at {address} has no node with a CPU to spare for a worker.")

    def start(self, count: int, spec: WorkerSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        task = ray.remote(run_worker)
        niceness = os.getpriority(os.PRIO_PROCESS, 0)  # the search's own, for its workers
        for index in range(count):
            options: dict[str, Any] = {
                "max_retries": 0,
                "name": f"autotune-worker-{spec.label}-{index}",
                "num_cpus": 1,
                "num_gpus": spec.ranks if spec.device == "cuda" else 0,
            }
            if spec.device == "cuda" and spec.ranks > 1:
                group = placement_group([{"GPU": 1, "CPU": 1}] * spec.ranks, strategy="STRICT_PACK")
                if not self._placed(group):
                    ray.util.remove_placement_group(group)
                    self.stop(grace=0)
                    raise BadInput(
                        f"--launcher ray: a worker of {spec.ranks} GPUs on one node could not be placed "
                        f"in {PLACEMENT_SECONDS:.0f} s (the cluster's GPUs are taken, or no node has "
                        f"{spec.ranks}); the study is kept: run the same command when they are free."
                    )
                self.groups.append(group)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group)
                options["num_cpus"] = 1
            self.refs.append(task.options(**options).remote(spec.command(), spec.environment(), niceness))

    @staticmethod
    def _placed(group: Any) -> bool:
        import ray

        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_SECONDS)
        return bool(ready)

    def alive(self) -> int:
        import ray

        if not self.refs:
            return 0
        _, running = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(running)

    def stop(self, grace: float) -> None:
        import ray

        for ref in self.refs:
            ray.cancel(ref, force=False)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        for ref in self.refs:
            ray.cancel(ref, force=True)  # (done tasks: nothing)
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        for group in self.groups:
            ray.util.remove_placement_group(group)
        self.groups = []

    def ends(self) -> list[WorkerEnd]:
        import json

        import ray

        ends = []
        for index, ref in enumerate(self.refs):
            name = f"ray task {index}"
            try:
                result = ray.get(ref, timeout=30)
            except Exception as exc:  # cancelled, or the task's worker died: said as the worker's failure
                ends.append(WorkerEnd(name, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
                continue
            self.results[index] = result
            name = f"ray task {index} on {result['host']} (node {result['node'][:8]}, worker pid {result['pid']})"
            try:
                summary = json.loads(result["stdout"] or "null")
            except ValueError:
                summary = None
            if result["code"] in (0, 130) and summary is not None:
                ends.append(WorkerEnd(name, summary))
            else:
                lines = [line for line in result["stderr"].splitlines() if line.strip()]
                ends.append(
                    WorkerEnd(
                        name,
                        None,
                        (lines[-1].removeprefix("autotune: error: ") if lines else f"exit status {result['code']}"),
                    )
                )
        return ends
