"""Processes autotune starts die with it. A probe child left running by a killed search would keep
its GPU memory while the resumed search probes, and every later OOM and timing would be wrong.

Two guards, because neither covers every case alone:
- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the child
  the moment its parent dies, kill -9 included, whatever the child is doing (a hung CUDA call too).
- A watchdog thread that polls the parent's pid: on other platforms, and for a parent that died
  in the instant before the signal was armed.
Torch-free and cheap: spawned children arm both before their heavy imports.

Linux sends the parent-death signal when the *thread* that started the child ends, not only the
process: start probe runners from a thread that outlives them (the main thread, as the CLI does).

A child's own children are not covered by either guard: the parent-death signal is not inherited,
and a model's own code (--trust-remote-code) may start a helper that ignores SIGTERM. So a probe
child leads a process group of its own (`lead_own_group`): its parent kills the whole group with
SIGKILL when it stops the child (`kill_group`), and a tiny guard forked in the group kills the group
when the child dies any other way (its parent killed with -9 included). A helper that starts a
session of its own (setsid) leaves the group, and is not covered.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP: the terminal closed) arrived: stop now (what a second Ctrl-C does). A
    KeyboardInterrupt, so that every `finally` and claim release on the way out runs as for Ctrl-C;
    the CLI exits 143 for it."""


def on_termination(handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
    """Install `handler` for SIGTERM and SIGHUP, the signals that ask a process to end (a cluster's
    scheduler, systemd, a closed terminal). SIGHUP stays ignored where it was ignored when this
    process started (`nohup autotune ...` asks to outlive the terminal). Returns the handlers
    replaced, by signal, for signal.signal to put back."""
    replaced: dict[int, Any] = {}
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is None or (signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN):
            continue
        replaced[signum] = signal.signal(signum, handler)
    return replaced


WATCHDOG_SECONDS = 1.0


def owner_label() -> str:
    """'host:pid': this process, as the owner of a running study or training run (stored, so that
    a later command can tell whether it is still there)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(owner: str | None) -> bool:
    """Whether the process an owner label names is gone, as far as this machine can tell: False
    for another host's process (its heartbeat tells), or a label of another form."""
    host, _, pid = (owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that pid: alive
        return False
    return _zombie(int(pid))


def _zombie(pid: int) -> bool:
    """A process that exited but was not reaped yet (Linux): gone for our purposes."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


# The signals that stop a command (autotune.cli.app: their handlers raise), held for the instant it
# takes to make a thing and hand it to the code that cleans it up (`signals_held`).
STOPPING_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block: one that comes in it arrives (its handler
    runs, and raises) just after, so that what the block made (a directory, a child process) already
    belongs to the code that removes or stops it. A signal at any other instant would leave it
    behind: a node stopped right after mkdtemp kept an empty directory in /tmp. Held by handlers
    that note the signal, not by the thread's signal mask: the kernel gives a process's signal to
    any thread that does not block it, and Python runs the handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (handlers run in the main thread: another thread's block is never interrupted by one)
        return
    arrived: list[int] = []
    replaced = {
        signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
        for signum in STOPPING_SIGNALS
        if callable(signal.getsignal(signum))
    }
    try:
        yield
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)
        for signum in arrived:
            signal.raise_signal(signum)  # (its own handler now: it raises, as it would have in the block)


def kill_me_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere nothing).
    Survives exec, so it is also what a Popen preexec_fn calls."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watchdog still holds
        pass


def name_this_process(name: str) -> None:
    """Set the name `ps`, `top` and /proc/PID/comm show for this process (Linux: its first 15
    bytes): a process forked from the fork server has the server's command line."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def lead_own_group() -> None:
    """Make this process the leader of a new session and process group (where it is not one
    already), which every process it starts joins, and fork a guard that SIGKILLs that group as soon
    as this process ends, however it ends. Call it first, before any thread starts (a fork copies
    only the calling thread) and before any code that may start processes. POSIX only."""
    if not hasattr(os, "setsid"):
        return
    if os.getpgid(0) != os.getpid():
        try:
            os.setsid()
        except OSError:  # (a group leader already: then the group is its own)
            return
    _fork_group_guard(os.getpid())


def _fork_group_guard(leader: int) -> None:
    """A process in the leader's group that waits for the leader's death (its parent-death signal,
    SIGUSR1 here, caught by sigwait) and then SIGKILLs the group, itself included. It holds no file
    of the leader's (a pipe held open would hide the leader's death from its parent) and ignores
    the signals meant for the work (SIGINT, SIGTERM, SIGHUP): only the group's end ends it."""
    if not sys.platform.startswith("linux"):  # no parent-death signal to wait on
        return
    try:
        pid = os.fork()
    except OSError:  # no process to spare: the parent's group kill still holds
        return
    if pid:
        return
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, _max_fd())
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        while os.getppid() == leader:  # (a leader that died before the prctl: at once)
            signal.sigtimedwait({signal.SIGUSR1}, 5.0)
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


# The janitor's whole program (`python -I -S -c`: no site, no autotune, tens of milliseconds): wait
# for its parent to die, its parent-death signal or a 5 s look (the signal comes when the *thread*
# that started it ends), then remove the path, again while what was writing into it dies too.
_JANITOR = """
import ctypes, os, shutil, signal, sys, time
parent, path = int(sys.argv[1]), sys.argv[2]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(signum, signal.SIG_IGN)
ctypes.CDLL(None).prctl(1, signal.SIGUSR1, 0, 0, 0)
while os.getppid() == parent:
    signal.sigtimedwait({signal.SIGUSR1}, 5.0)
until = time.monotonic() + 30
while os.path.lexists(path) and time.monotonic() < until:
    shutil.rmtree(path, ignore_errors=True)
    time.sleep(0.2)
"""


def remove_when_i_die(path: str) -> Any:
    """A tiny process (its own session: a Ctrl-C at the terminal is not for it) that removes `path`
    once this process has died, however it died, kill -9 included: a directory this process would
    remove on its way out, were it given one. Stop it (stop_janitor) once the path is removed.
    Linux only (it waits on the parent-death signal); elsewhere None."""
    import subprocess

    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _JANITOR, str(os.getpid()), path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def stop_janitor(janitor: Any) -> None:
    """End a janitor whose path its parent removed itself, and reap it."""
    if janitor is None:
        return
    with contextlib.suppress(OSError):
        janitor.kill()
    with contextlib.suppress(Exception):
        janitor.wait(timeout=5)


def _max_fd() -> int:
    try:
        return min(os.sysconf("SC_OPEN_MAX"), 1 << 20)
    except (OSError, ValueError):
        return 1024


def kill_group(leader: int) -> None:
    """SIGKILL the process group `leader` leads (a child started with lead_own_group, and every
    process it started that stayed in the group); nothing when there is none. A pid is not handed
    out again while a group of that id has members, so this reaches no one else's processes."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def watch_parent(parent_pid: int, interval: float = WATCHDOG_SECONDS) -> None:
    """Exit at once (no cleanup: the parent that wanted the results is gone) when the parent dies."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    if os.getppid() != parent_pid:  # died before we got here
        os._exit(1)
    threading.Thread(target=watch, name="autotune-parent-watchdog", daemon=True).start()


# OpenMP's threads wait for each other by spinning by default: on a host busier than its cores (other
# jobs, a test suite, a shared node) each thread's spin takes the slices another one needs, and a
# probe's steps ran 3x slower than with the threads sleeping while they wait (measured on 2 cores
# beside 4 busy processes: 40 tokens/s against 130; idle, no slower). Set for every process
# autotune runs torch in (probe and trace children, train, its ranks), unless the user set it.
OPENMP_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def quiet_openmp() -> None:
    """OPENMP_ENVIRONMENT in this process's environment (and its children's), where not set: before
    torch is imported, which reads it once."""
    for name, value in OPENMP_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off while torch and transformers are imported. Their import makes
    about a million lasting objects (modules, functions, classes), and the collector, triggered by
    every 700 new ones, went over the ever larger heap again and again to find almost no garbage:
    the import took 11% more CPU with it on (whole processes, median of 8 pairs on a 2-core
    machine, 6.3 s against 5.6 s). Every process that imports them pays it: each fork server,
    rank, trace and probe child."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_as_child(
    parent_pid: int,
    target: str,
    *args: object,
    environment: dict[str, str | None] | None = None,
    forked_for: dict[str, str] | None = None,
) -> None:
    """A spawn target: tie this process to `parent_pid`, then import and call `target`
    ('package.module:function') with `args`. The import comes after the guards, so a child killed
    with its parent during torch's import leaves nothing behind either. `environment` is set (None:
    unset) before the import, for settings read once at start-up (the CUDA allocator's).

    `forked_for`: this process was forked by the fork server (fork_server_context), not spawned by
    `parent_pid`, and this is that parent's environment now: it replaces the one the server was
    started with (what a spawned child would have inherited). Its own parent is the server, which
    exits when `parent_pid` dies: the parent-death signal covers the server, the watchdog both."""
    kill_me_with_parent()
    lead_own_group()  # (before the watchdog's thread: it forks)
    if forked_for is None:
        watch_parent(parent_pid)
    else:
        watch_owner(parent_pid)
        os.environ.clear()
        os.environ.update(forked_for)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (the server ignores it: preload.py)
    quiet_openmp()
    for name, value in (environment or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    module, _, function = target.partition(":")
    with collector_paused():
        entry = getattr(importlib.import_module(module), function)
    entry(*args)


def watch_owner(owner_pid: int, interval: float = WATCHDOG_SECONDS) -> None:
    """watch_parent for a process forked by the fork server: exit at once when its parent (the
    server) or `owner_pid` (the process the server serves) is gone."""
    server = os.getppid()

    def gone() -> bool:
        if os.getppid() != server:
            return True
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return _zombie(owner_pid)

    if gone():
        os._exit(1)

    def watch() -> None:
        while not gone():
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="autotune-owner-watchdog", daemon=True).start()


# The modules a probe child spends its start-up importing (about 6.5 s of CPU on 2 cores: torch
# 2.3 s, transformers 1.3 s, its modeling utilities 3 s, which import torch.distributed.tensor and
# torch._dynamo), imported once by the fork server: each probe child forked from it starts in
# a fraction of a second instead.
FORK_SERVER_PRELOAD = "autotune.probe.preload"
# A change of an environment variable since the fork server started (PYTHONPATH, a torch or OpenMP
# setting, HF_HOME) starts it again: the modules it imported read theirs then. Except autotune's own
# (AUTOTUNE_*: read by its code when it runs, and the server imports none that reads one) and
# pytest's name of the test running, which change between the commands of one long-lived process.
RUN_TIME_PREFIXES = ("AUTOTUNE_", "PYTEST_CURRENT_TEST")
FORK_SERVER_OWNER_ENV = "AUTOTUNE_FORK_SERVER_OWNER"
_fork_server: dict[str, Any] = {"environment": None}  # (and its "janitor", once started)
_fork_server_lock = threading.Lock()


def fork_server_context(cuda_possible: bool) -> Any:
    """The multiprocessing context to start torch children with: a fork server that has imported
    torch and transformers once (FORK_SERVER_PRELOAD), where that is safe and saves seconds a child;
    else spawn. Call fork_server_current before each child is started from it.

    Only where no CUDA can be used (`cuda_possible` False) and on Linux: a process forked from one
    that touched the CUDA driver cannot use it, and a probe's CUDA settings (the allocator's) are
    read when torch starts, so CUDA children keep starting afresh (and a standby hides the wait).
    Each child gets its parent's environment of the moment (run_as_child's `forked_for`).

    How they die with this process: the server dies with the thread that started it (its
    parent-death signal, set by FORK_SERVER_PRELOAD), and each child with the server (its own);
    so the server is started from the main thread only (`use_fork_server`)."""
    import multiprocessing as mp

    if cuda_possible or not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([FORK_SERVER_PRELOAD])
    return context


def tie_fork_server_to_owner() -> None:
    """In the fork server, first: die with the process that started it, also when that one died
    while this one was starting (then the parent-death signal never comes)."""
    kill_me_with_parent()
    owner = os.environ.get(FORK_SERVER_OWNER_ENV)
    if owner is not None and os.getppid() != int(owner):
        os._exit(1)


def use_fork_server(context: Any) -> bool:
    """Whether to start the next child from `context`'s fork server: a fork server context, and
    this the main thread (a server started by another thread would die when that thread ends,
    with every child it forked: a service's searches run in threads)."""
    return context.get_start_method() == "forkserver" and threading.current_thread() is threading.main_thread()


def fork_server_fits() -> bool:
    """Whether a child forked now would not restart the fork server (fork_server_current): none
    started yet, or it started with this process's environment of now. A restart kills the children
    forked from the old server, a runner's warm probe child among them: a process that is not worth
    that (a trace child) is spawned instead."""
    with _fork_server_lock:
        started = _fork_server["environment"]
    return started is None or started == _server_environment()


def _server_environment() -> dict[str, str]:
    """This process's environment as far as the fork server's imports may have read it. OpenMP's
    settings as the server has them: it sets them where unset (quiet_openmp, in preload.py), so that
    this process setting them later (the CLI's main does, run in process) changes nothing for it."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith(RUN_TIME_PREFIXES)}
    for name, value in OPENMP_ENVIRONMENT.items():
        environment.setdefault(name, value)
    return environment


def fork_server_current() -> None:
    """Stop the fork server if this process's environment changed since it started (beyond
    RUN_TIME_PREFIXES): the next child starts a new one, whose imports read the environment of now.
    Children forked from the old one die with it (their parent-death signal): their runners start
    others when they next probe."""
    from multiprocessing import util

    environment = _server_environment()
    # For the server to tell whether this process died before it armed its parent-death signal.
    os.environ[FORK_SERVER_OWNER_ENV] = str(os.getpid())
    with _fork_server_lock:
        if "janitor" not in _fork_server:
            # The server listens on a socket in a directory of multiprocessing's (/tmp/pymp-*),
            # removed when this process exits normally; a janitor removes it after a kill -9 too.
            _fork_server["janitor"] = remove_when_i_die(util.get_temp_dir())
        # Where the server says its preload is over (start_forked): that same directory.
        os.environ[FORK_SERVER_READY_ENV] = util.get_temp_dir()
        if _fork_server["environment"] not in (None, environment):
            _kill_fork_server()
        _fork_server["environment"] = environment


def _kill_fork_server() -> None:
    """Kill multiprocessing's fork server, if it runs; the next child forked starts a new one.
    (Private, Python 3.8+. The server ends by itself only once every child it forked has ended too
    (they hold its "alive" pipe): killed instead, it takes them along.)"""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # (multiprocessing's private state: typeshed does not list it)
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()


def start_forked(process: Any, limit: float) -> None:
    """`process.start()` for a process of the fork server's context, within `limit` seconds; else
    TimeoutError, the server killed (the next child starts a new one). multiprocessing waits for the
    server's answer without a limit, and a server just started answers only once its preload (torch's
    imports: seconds, more on a busy host) is done: a command's deadline would wait for that. So the
    server says when its preload is over (fork_server_ready, a file named by its pid), and that is
    what is waited for here, by the clock."""
    from multiprocessing import forkserver

    forkserver.ensure_running()  # (an OSError here: the server cannot start; the caller spawns)
    server: Any = forkserver._forkserver
    ready = _ready_file(server._forkserver_pid)
    until = time.monotonic() + max(0.0, limit)
    while FORK_SERVER_READY_ENV in os.environ and not os.path.exists(ready):  # (set by fork_server_current)
        if time.monotonic() >= until:
            _kill_fork_server()
            raise TimeoutError(f"the fork server did not finish its imports within {limit:.1f} s")
        time.sleep(READY_POLL_SECONDS)
    process.start()


# The least time a child process is given to start (torch and transformers imported): imports take
# seconds, more on a busy host.
STARTUP_FLOOR_SECONDS = 60.0
READY_POLL_SECONDS = 0.02
FORK_SERVER_READY_ENV = "AUTOTUNE_FORK_SERVER_READY_DIR"


def _ready_file(server_pid: int | None) -> str:
    return os.path.join(os.environ.get(FORK_SERVER_READY_ENV, ""), f"fork-server-{server_pid}-ready")


def fork_server_ready() -> None:
    """In the fork server, once its preload is over (or has failed: then the next child's start
    fails at once): said to start_forked, which waits for it. Before fork_server_current, whose
    process it runs in, named the directory, nothing is said."""
    if os.environ.get(FORK_SERVER_READY_ENV):
        with contextlib.suppress(OSError):
            open(_ready_file(os.getpid()), "w").close()
