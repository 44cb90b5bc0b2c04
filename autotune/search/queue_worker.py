"""`autotune worker --queue`: serve the service's queue from this machine. It takes the oldest
queued search its device can serve (its kind, a card's name where one is asked for, memory at least
the budget, enough ranks), checks it as the service and the command line check it
(search/request_flags.py), runs it as `autotune search --json` in a child process (the same command,
so the same preflight, fleet machinery, claims, heartbeats, confirmation round and stored outcome),
heartbeats the queue row while it runs, stops it when a client cancels, records how it ended, and
takes the next.

How it ended is read from what the search says it did (its `--json` outcome on stdout) and from the
store (the study and its pick), never from its log: stderr is relayed to this worker's log and
nothing is concluded from it. A search refused before it starts is refused here, in this process,
with the reason the check raised. With nothing queued it joins a running search its device matches (as `autotune
worker --study` does), so several workers serve one search.

Nothing is left behind: each child dies with this worker (kill -9 included: the parent-death signal)
and its probes with it (they lead their own groups, processes.py); SIGTERM or Ctrl-C stops the
child's search (the probe in flight ended, the study resumable) and records it interrupted. A
worker killed outright leaves its search `running` under a dead holder, which reads as interrupted
and is taken up again by the next worker (store/queue.py): the study resumes, nothing settled lost.

Children run in an empty directory of their own, removed when they end: a relative path in a request names nothing there
(the service refuses local paths outside its --model-root; this keeps a worker's files out of reach
too)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from autotune.vocabulary.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, AutotuneError, DatabaseError
from autotune.host.processes import Terminated, kill_me_with_parent, owner_label
from autotune.vocabulary.status import FINISHING, SearchState, StudyStatus
from autotune.store.queue import QUEUE_HEARTBEAT_SECONDS
from autotune.store.records import SearchRecord
from autotune.store.workers import ServingDevice

STOPPED_BY_SIGNAL = (EXIT_INTERRUPTED, EXIT_TERMINATED, -signal.SIGTERM, -signal.SIGINT)
# A child asked to stop has this long to end its probe and record the study before it is killed.
STOP_GRACE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class WorkerDevice:
    """This worker's device: what it can serve (store/workers.py decides), and how its children name it."""

    device: str  # --device, as the children get it
    kind: str  # cuda | cpu
    name: str  # the device's name ('NVIDIA A10G', 'cpu: ...')
    total_bytes: int | None
    ranks: int  # GPUs visible (cuda), or CPU ranks at once
    fingerprint: str  # the environment's: a joined study must match it

    @property
    def serving(self) -> ServingDevice:
        return ServingDevice(self.kind, self.name, self.total_bytes, self.ranks)

    def can_serve(self, search: SearchRecord) -> bool:
        return self.serving.can_serve(search)

    def describe(self) -> str:
        return self.serving.describe()


def describe_device(device: str) -> WorkerDevice:
    """This worker's device, as a probe child sees it (one child, started once)."""
    from autotune.host.deadline import Deadline
    from autotune.probe import ProbeRunner, ProbeSettings
    from autotune.search.fleet import visible_gpus
    from autotune.levers.sharding import most_cpu_ranks

    with ProbeRunner(ProbeSettings(device=device)) as runner:
        environment = runner.environment(Deadline.after(300.0))
    if environment.device_type == "cpu":
        ranks = most_cpu_ranks(False)
    else:
        ranks = 1 if ":" in device else max(1, len(visible_gpus()))
    return WorkerDevice(
        device,
        environment.device_type,
        environment.device_name,
        environment.device_total_bytes,
        ranks,
        environment.fingerprint(),
    )


@dataclass(frozen=True, slots=True)
class ChildEnd:
    """How a child ended: its exit status, who cancelled it (or None), and the outcome it said
    (a search's --json object; None where it said none)."""

    code: int
    cancelled: str | None
    outcome: dict | None


def _outcome_of(text: str) -> dict | None:
    try:
        said = json.loads(text)
    except ValueError:
        return None
    return said if isinstance(said, dict) and "stop_reason" in said else None


@dataclass(slots=True)
class QueueOutcome:
    searches: int = 0  # searches this worker ran (as their starter)
    joined: int = 0  # searches it helped (as `autotune worker --study`)
    interrupted: bool = False
    terminated: bool = False  # by SIGTERM (Ctrl-C otherwise)

    @property
    def exit_status(self) -> int:
        """0, or the status of the signal that stopped it (143 for SIGTERM, 130 for Ctrl-C)."""
        if not self.interrupted:
            return 0
        return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED


class QueueWorker:
    """One worker's loop over the queue (see the module docstring)."""

    def __init__(
        self,
        store,
        db_url: str,
        device: WorkerDevice,
        *,
        say: Callable[[str], None] = print,
        poll_seconds: float = 1.0,
        join: bool = True,
    ) -> None:
        self.store, self.db_url, self.device, self.say = store, db_url, device, say
        self.poll_seconds, self.join = poll_seconds, join
        self.label = owner_label()
        self.stopping = False
        self.terminated = False
        self.child: subprocess.Popen | None = None
        self.heard_at = time.monotonic()

    # -- the loop --------------------------------------------------------------------------------

    def run(self, *, max_searches: int | None = None, deadline: float | None = None) -> QueueOutcome:
        """Serve until stopped (SIGTERM, Ctrl-C), `max_searches` run, or `deadline` (monotonic)."""
        outcome = QueueOutcome()
        # Connected (the registry) before it says it serves: a reader of that line finds it listed.
        self._registry(self.store.workers.announce, self.label, self.device.serving)
        self.say(f"worker {self.label}: serving the queue of {self.store.url} on {self.device.describe()}")
        try:
            while not self.stopping and (max_searches is None or outcome.searches < max_searches):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                search = self._take()
                if search is not None:
                    outcome.searches += 1
                    self.run_search(search)
                    continue
                joinable = self._joinable() if self.join else None
                if joinable is not None:
                    outcome.joined += 1
                    self.join_search(joinable)
                    continue
                time.sleep(self.poll_seconds)
        except KeyboardInterrupt as stop:
            self._stopped_by(stop)
        finally:
            self._stop_child()
            self._registry(self.store.workers.leave, self.label)
        # Stopped by a signal, wherever it came (between searches, or while a child ran: its
        # search was put back in the queue): the worker says so by its exit status (143, 130).
        outcome.interrupted, outcome.terminated = self.stopping, self.terminated
        return outcome

    def _stopped_by(self, stop: KeyboardInterrupt) -> None:
        self.stopping = True
        self.terminated = self.terminated or isinstance(stop, Terminated)

    def _registry(self, write: Callable, *args) -> None:
        """Tell the registry of connected workers (store/workers.py); the queue goes on without it."""
        try:
            write(*args)
        except DatabaseError:
            pass

    def _heard(self) -> None:
        """This worker is alive, said to the registry at most once a heartbeat."""
        now = time.monotonic()
        if now - self.heard_at >= QUEUE_HEARTBEAT_SECONDS:
            self.heard_at = now
            self._registry(self.store.workers.seen, self.label)

    def _take(self) -> SearchRecord | None:
        self._heard()
        try:
            return self.store.queue.take(self.label, self.device.can_serve)
        except DatabaseError as exc:
            self.say(f"worker {self.label}: the database cannot be used now ({exc}); trying again")
            return None

    def _joinable(self) -> SearchRecord | None:
        """A running search this device can help with: its study on the same environment."""
        try:
            for search in self.store.queue.running():
                if search.worker == self.label or search.cancel_requested or not self.device.can_serve(search):
                    continue
                try:
                    study = self.store.study(search.name)
                except AutotuneError:
                    continue
                if (
                    study.plan
                    and study.env_fingerprint == self.device.fingerprint
                    and study.status == StudyStatus.RUNNING
                ):
                    return search
        except DatabaseError:
            return None
        return None

    # -- one search ------------------------------------------------------------------------------

    def run_search(self, search: SearchRecord) -> SearchState:
        """Run `search` as `autotune search --json` in a child, until it ends or is cancelled."""
        self.say(f"worker {self.label}: running {search.name} (attempt {search.attempts})")
        refused = self._refusal(search)
        code: int | None = None
        if refused is not None:
            state, reason = SearchState.FAILED, f"refused by its worker: {refused}"
        else:
            command = self.search_command(search)
            ended = self._supervise(command, search, own=True)
            code = ended.code
            state, reason = self._ending(search, ended)
        try:
            if state == SearchState.QUEUED:
                self.store.queue.requeue(search.id, self.label, reason)
            else:
                self.store.queue.end(search.id, self.label, state, reason, exit_status=code)
        except DatabaseError as exc:  # its heartbeat stops: it reads as interrupted, and is resumed
            self.say(f"worker {self.label}: could not record how {search.name} ended ({exc})")
        self.say(f"worker {self.label}: {search.name} {state}: {reason}")
        return state

    def search_command(self, search: SearchRecord) -> list[str]:
        """The child that runs `search`: `autotune search --json` on this worker's device."""
        return [
            sys.executable,
            "-m",
            "autotune",
            "search",
            *search.arguments,
            "--study",
            search.name,
            "--db",
            self.db_url,
            "--device",
            self.device.device,
            "--json",
        ]

    def _refusal(self, search: SearchRecord) -> str | None:
        """Why this worker cannot run `search` (its flags read as `autotune search` reads them, on
        this worker's device), or None: the reason as the check raised it, not read from a log."""
        import click

        from autotune.flags.flag import parse, reading_command, refusal_line
        from autotune.flags.table import SEARCH
        from autotune.search.request_flags import resolve_search_flags

        try:
            resolve_search_flags(
                parse(reading_command("search", SEARCH), [*search.arguments, "--device", self.device.device])
            )
        except (AutotuneError, click.ClickException) as exc:
            return refusal_line(exc)
        return None

    def join_search(self, search: SearchRecord) -> None:
        """Probe `search`'s study beside its starter, as `autotune worker --study` does."""
        self.say(f"worker {self.label}: joining {search.name}")
        command = [
            sys.executable,
            "-m",
            "autotune",
            "worker",
            "--study",
            search.name,
            "--db",
            self.db_url,
            "--device",
            self.device.device,
        ]
        self._supervise(command, search, own=False)

    def _supervise(self, command: list[str], search: SearchRecord, *, own: bool) -> ChildEnd:
        """Run `command`; beat the row while it runs (`own`), stop it on a cancel or when this worker
        stops."""
        with tempfile.TemporaryDirectory(prefix="autotune-queue-") as workdir:
            return self._run_child(command, search, workdir, own=own)

    def _run_child(self, command: list[str], search: SearchRecord, workdir: str, *, own: bool) -> ChildEnd:
        said: list[str] = []  # stdout: a search's --json outcome, read whole when it ends
        self.child = subprocess.Popen(
            command,
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            preexec_fn=kill_me_with_parent,
        )
        readers = [
            threading.Thread(target=self._relay, args=(self.child.stderr, search.name, None), daemon=True),
            # (a search's --json outcome is kept, not logged; a joining worker's stdout is its progress)
            threading.Thread(
                target=self._relay, args=(self.child.stdout, search.name, said if own else None), daemon=True
            ),
        ]
        for reader in readers:
            reader.start()
        cancelled: str | None = None
        try:
            while self.child.poll() is None:
                time.sleep(QUEUE_HEARTBEAT_SECONDS if own else self.poll_seconds)
                if self.child.poll() is not None:
                    break
                self._heard()
                row = self._beat(search) if own else self._read(search)
                if row is False:  # no longer this worker's (taken over after it looked dead): let go
                    self._signal_child(signal.SIGTERM)
                elif isinstance(row, SearchRecord) and row.cancel_requested and cancelled is None:
                    cancelled = (row.reason or "").removeprefix("cancel asked").split(";")[0].strip() or "a client"
                    self.say(f"worker {self.label}: cancelling {search.name}")
                    self._signal_child(signal.SIGTERM)
                    self._kill_after_grace()
        except KeyboardInterrupt as stop:  # (SIGTERM too: Terminated) this worker stops; so does its child's search
            self._stopped_by(stop)
            self._stop_child()
        finally:
            for reader in readers:
                reader.join(timeout=5)
        code = self.child.wait()
        self.child = None
        return ChildEnd(code, cancelled, _outcome_of("".join(said)))

    def _relay(self, stream, name: str, kept: list[str] | None) -> None:
        """A child's stream into this worker's log, line by line, or `kept` whole (a search's --json
        outcome). Nothing is concluded from the log's words."""
        for line in stream:
            if kept is not None:
                kept.append(line)
            else:
                self.say(f"[{name}] {line.rstrip(chr(10))}")

    def _beat(self, search: SearchRecord) -> SearchRecord | None | bool:
        try:
            row = self.store.queue.beat(search.id, self.label)
        except DatabaseError:
            return None  # the child's own writes fail too, and end it; until then, carry on
        return False if row is None else row

    def _read(self, search: SearchRecord) -> SearchRecord | None:
        try:
            return self.store.queue.get(search.name)
        except AutotuneError:
            return None

    def _ending(self, search: SearchRecord, ended: ChildEnd) -> tuple[SearchState, str]:
        """How a search ended: a cancel or a signal as this worker saw them; otherwise what the
        search said it did (its --json outcome) and its study as stored."""
        if ended.cancelled is not None:
            return (
                SearchState.CANCELLED,
                f"cancelled by {ended.cancelled.removeprefix('by ')}; submit it again to resume",
            )
        if ended.code in STOPPED_BY_SIGNAL and self.stopping:
            # Not the client's wish: the next worker that can serve it resumes it.
            return SearchState.QUEUED, f"its worker ({self.label}) was stopped; queued for the next worker to resume"
        if ended.code in STOPPED_BY_SIGNAL:
            return SearchState.INTERRUPTED, "its search process was stopped by a signal; submit it again to resume"
        outcome = ended.outcome
        if outcome is None:  # it said no outcome: it refused, or died, before the end
            how = f"signal {-ended.code}" if ended.code < 0 else f"exit status {ended.code}"
            return SearchState.FAILED, (
                f"the search process ended with {how} before saying an outcome (its log is in its worker's "
                f"output); submit it again to resume"
            )
        if outcome.get("unmeasured"):
            return SearchState.FAILED, (
                f"{len(outcome['unmeasured'])} candidate(s) could not be measured; submit it again to retry them"
            )
        if outcome.get("stop_reason") in FINISHING and self._study_status(search) == StudyStatus.FINISHED:
            return SearchState.FINISHED, self._pick(search)
        return SearchState.INTERRUPTED, "stopped by its own limit (--timeout or --max-trials); submit it again to go on"

    def _study_status(self, search: SearchRecord) -> str | None:
        try:
            return self.store.study(search.name).status
        except AutotuneError:
            return None

    def _pick(self, search: SearchRecord) -> str:
        """The pick as stored (the leaderboard's first), or that nothing fits."""
        try:
            best = self.store.leaderboard(search.name, top=1)
        except AutotuneError:
            best = []
        if not best:
            return "every candidate settled: no configuration fits the budget"
        return f"every candidate settled; the pick: {best[0].label}, {best[0].tokens_per_s:,.0f} tokens/s"

    # -- stopping --------------------------------------------------------------------------------

    def _signal_child(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            try:
                self.child.send_signal(signum)
            except ProcessLookupError:
                pass

    def _kill_after_grace(self) -> None:
        child = self.child

        def later() -> None:
            try:
                child.wait(STOP_GRACE_SECONDS)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                child.kill()  # type: ignore[union-attr]

        threading.Thread(target=later, daemon=True).start()

    def _stop_child(self) -> None:
        """Stop the child's search (as SIGTERM stops it: the probe in flight ended, the study
        recorded) and wait for it; killed past the grace."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        self._signal_child(signal.SIGTERM)
        try:
            child.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def serve_queue(
    db: str | None,
    device: str,
    *,
    say: Callable[[str], None] = print,
    poll_seconds: float = 1.0,
    max_searches: int | None = None,
    timeout: float | None = None,
    join: bool = True,
) -> QueueOutcome:
    """`autotune worker --queue`: open the database, learn the device, serve the queue."""
    from autotune.store import open_store
    from autotune.store.engine import check_service_database

    check_service_database(db)
    with open_store(db) as store:
        url = store.engine.url.render_as_string(hide_password=False)
        found = describe_device(device)
        worker = QueueWorker(store, url, found, say=say, poll_seconds=poll_seconds, join=join)
        deadline = time.monotonic() + timeout if timeout else None
        return worker.run(max_searches=max_searches, deadline=deadline)
