"""The plans being worked out: `POST /v1/plan` (and the plan page's form) starts one as a job that
holds a prediction slot while its child runs; the request waits a short while for it, and answers
with the plan where it came in time, else `202 Accepted` and where to ask again (`/v1/plans/ID`,
`/plans/ID`). Only the token that asked reads a plan. A plan nobody asks about for a while is
stopped (its child killed, its slot freed), and an ended plan's answer is kept a while, a bounded
number of them. Torch-free, and FastAPI-free: the routes (routes/predictions.py, routes/pages.py)
say it over HTTP."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("autotune.service")

# How long POST /v1/plan waits for its plan before answering 202. A plan answered from the estimate
# cache takes a second or two (no trace child is started for it: 1.4 s on two busy cores), and
# clients that call the API as they always have get it at once, with 200; a cold plan takes minutes
# (gpt2 on an H100: 104 s), past the 60 s after which common proxies (nginx, AWS's load balancers)
# drop a silent request, so it is answered long before any of them would.
PLAN_WAIT_SECONDS = 10.0
# A running plan nobody has asked about (POST's answer, or a GET of it) for this long is stopped and
# frees its slot: its client polls every few seconds (Retry-After says 2), so a minute of silence is a
# client gone, not a slow one, and a plan does not trace on for nobody while others wait for the slot.
PLAN_IDLE_SECONDS = 60.0
# Ended plans' answers kept in memory: each for this long after it ended (a poller reads it within
# seconds; minutes leave room for a client that retries), and at most this many (the oldest dropped
# first): a plan of every card at four counts is about 100 KB of JSON, so a few MB at most.
PLAN_KEPT_SECONDS = 600.0
PLANS_KEPT = 64
# How often a running plan is checked for silence, and how often its poller is asked to come back.
PLAN_TICK_SECONDS = 0.5
PLAN_RETRY_SECONDS = 2


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a plan ended, as its answer: an HTTP status and the JSON document (the plan, or
    `{"error": "one line"}`)."""

    status: int
    document: dict[str, Any]

    @classmethod
    def refused(cls, status: int, line: str) -> Outcome:
        return cls(status, {"error": line})


@dataclass(eq=False, slots=True)
class PlanJob:
    """One plan: who asked, what (the request's fields, for the page to show again), since when,
    when it was last asked about, and how it ended once it has."""

    id: str
    owner: str
    body: dict[str, Any]
    started: float  # monotonic
    started_at: str  # the wall clock's, ISO 8601
    seen: float  # monotonic: when its client last asked
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    ended: float | None = None  # monotonic
    stopped: Outcome | None = None  # why it was stopped, where it was
    task: asyncio.Task | None = None
    progress: tuple[int, int] | None = None  # (traced, of) as its child last said; None before

    def report(self, done: int, total: int) -> None:
        self.progress = (done, total)

    @property
    def links(self) -> dict[str, str]:
        return {"self": f"/v1/plans/{self.id}", "page": f"/plans/{self.id}"}

    def elapsed(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.started

    def view(self, now: float) -> dict[str, Any]:
        """A running plan as GET /v1/plans/ID says it (with 202)."""
        return {
            "plan": self.id,
            "state": "running",
            "started_at": self.started_at,
            "elapsed_seconds": round(self.elapsed(now), 1),
            # (the total grows as the plan finds what it still has to trace: `autotune plan`'s count)
            "progress": None if self.progress is None else {"traced": self.progress[0], "of": self.progress[1]},
            "retry_after_seconds": PLAN_RETRY_SECONDS,
            "links": self.links,
        }


class PlanNotFound(LookupError):
    """No plan of that id for that token (none, another token's, or one forgotten)."""


class PlanJobs:
    """The service's plans by id: those running (each holding a prediction slot, so at most as many
    as there are slots) and the last PLANS_KEPT ended ones, each for PLAN_KEPT_SECONDS."""

    def __init__(
        self,
        *,
        idle_seconds: float = PLAN_IDLE_SECONDS,
        kept: int = PLANS_KEPT,
        kept_seconds: float = PLAN_KEPT_SECONDS,
        tick_seconds: float = PLAN_TICK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_seconds, self.kept, self.kept_seconds = idle_seconds, kept, kept_seconds
        self.tick_seconds, self.clock = tick_seconds, clock
        self._jobs: dict[str, PlanJob] = {}

    def start(
        self,
        owner: str,
        body: dict[str, Any],
        work: Callable[[PlanJob], Awaitable[Outcome]],
        release: Callable[[], None],
    ) -> PlanJob:
        """Run `work(job)` (the child, to its end; it may `job.report` its progress) as a plan of
        `owner`'s; `release` (its slot) is called once it has ended, however it ends."""
        self._prune()
        now = self.clock()
        job = PlanJob(
            id=secrets.token_urlsafe(12),
            owner=owner,
            body=dict(body),
            started=now,
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            seen=now,
        )
        self._jobs[job.id] = job
        job.task = asyncio.ensure_future(self._supervise(job, work(job), release))
        return job

    def get(self, plan_id: str, owner: str) -> PlanJob:
        """The plan `plan_id` of `owner`'s, marked as asked about now; PlanNotFound for any other
        token's, as for one that does not exist (an id says nothing to whoever did not ask for it)."""
        self._prune()
        job = self._jobs.get(plan_id)
        if job is None or job.owner != owner:
            raise PlanNotFound(plan_id)
        job.seen = self.clock()
        return job

    def touch(self, job: PlanJob) -> None:
        job.seen = self.clock()

    async def stop(self, job: PlanJob, outcome: Outcome) -> None:
        """Stop `job` (its child killed and reaped, its slot freed) and say `outcome` for it."""
        if job.outcome is None and job.stopped is None and job.task is not None:  # (not already stopping)
            job.stopped = outcome
            job.task.cancel()
        await job.done.wait()

    def forget(self, job: PlanJob) -> None:
        """Drop an ended plan whose answer its client has (POST's own)."""
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]

    @property
    def running(self) -> list[PlanJob]:
        return [job for job in self._jobs.values() if job.outcome is None]

    async def close(self) -> None:
        """The service stops: every running plan is stopped with it."""
        for job in self.running:
            await self.stop(job, Outcome.refused(503, "the service stopped; post the plan again."))

    async def _supervise(self, job: PlanJob, work: Awaitable[Outcome], release: Callable[[], None]) -> None:
        runner = asyncio.ensure_future(work)
        try:
            while not runner.done():
                await asyncio.wait([runner], timeout=self.tick_seconds)
                if not runner.done() and self.clock() - job.seen > self.idle_seconds:
                    log.info("plan %s stopped: nobody asked about it for %.0f s", job.id, self.idle_seconds)
                    job.stopped = Outcome.refused(
                        410,
                        f"nobody asked about this plan for {self.idle_seconds:.0f} s, so it was stopped; "
                        f"post it again (and ask GET /v1/plans/ID every few seconds until it ends).",
                    )
                    break
        except asyncio.CancelledError:
            pass  # (stop() or close(): job.stopped says why)
        finally:
            if not runner.done():
                runner.cancel()  # the child is killed and reaped as its runner unwinds
                await asyncio.wait([runner])
            job.outcome = job.stopped or _result(runner)
            job.ended = self.clock()
            release()
            job.done.set()

    def _prune(self) -> None:
        now = self.clock()
        ended = sorted((job for job in self._jobs.values() if job.ended is not None), key=lambda job: job.ended or 0.0)
        for index, job in enumerate(ended):
            if now - (job.ended or now) > self.kept_seconds or index < len(ended) - self.kept:
                del self._jobs[job.id]


def _result(runner: asyncio.Future) -> Outcome:
    if runner.cancelled():
        return Outcome.refused(503, "the plan was stopped.")
    error = runner.exception()
    if error is not None:  # a bug: logged with its traceback, said in one line
        log.error("a plan failed", exc_info=error)
        return Outcome.refused(500, "the service failed on this plan; its log has the details.")
    return runner.result()
