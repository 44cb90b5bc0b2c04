"""/v1/plan and /v1/estimate: the predictions, without a GPU. The body is the command's flags (the
table of its flags, autotune/flags/table.py); the command runs in a child process, `--json`, as a user's shell would
run it (its traces in their own processes, its cache shared), a few at a time, each held to a limit.

An estimate (one trace) is answered in its request. A plan may take minutes (every card and count
traced cold): it runs as a job (service/plans.py) that the request waits for a few seconds, and is
otherwise answered `202 Accepted` with where to ask for it: `GET /v1/plans/ID`."""

from __future__ import annotations

import asyncio
import logging
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from autotune.vocabulary.errors import EXIT_USER_ERROR
from autotune.service.auth import require_writer
from autotune.service.commands import RequestRefused, read_request
from autotune.service.plans import PLAN_KEPT_SECONDS, PLAN_RETRY_SECONDS, Outcome, PlanJob, PlanJobs, PlanNotFound
from autotune.service.routes.searches import json_body

router = APIRouter(tags=["predictions"])
log = logging.getLogger("autotune.service")

SLOT_WAIT_SECONDS = 30.0
CLIENT_POLL_SECONDS = 0.5


def checked(app, command_name: str, body: object) -> tuple[str, ...]:
    """`body` (the command's flags) read as the command line reads them, with the service's own
    refusals (a model's own code, `--gpu list`): the child's arguments."""
    config = app.state.config
    parsed, _ = read_request(command_name, config.policy.named(body))
    if parsed.params.get("trust_remote_code") and not config.policy.allow_remote_code:
        raise RequestRefused(
            "trust_remote_code: this service does not run a model's own code; its operator allows it "
            "with autotune serve --allow-remote-code.",
            status=403,
        )
    if command_name == "plan" and str(parsed.params.get("gpu_name") or "").strip().lower() == "list":
        raise RequestRefused(
            "gpu 'list' lists the cards on the command line (autotune plan --gpu list); name one here."
        )
    return parsed.arguments


async def take_slot(app) -> None:
    """One of the service's prediction slots, waited for a while (503 after SLOT_WAIT_SECONDS)."""
    slots: asyncio.Semaphore = app.state.predicting
    try:
        await asyncio.wait_for(slots.acquire(), SLOT_WAIT_SECONDS)
    except TimeoutError:
        raise RequestRefused(
            f"the service is busy predicting (at most {app.state.config.predict_slots} at once); try again shortly.",
            status=503,
        ) from None


async def predict_body(app, command_name: str, body: object, request: Request | None = None) -> JSONResponse:
    """An estimate for `body` (the command's flags): checked, then run in a child, a few at a time,
    stopped when its client goes away (`request`: it would hold a slot for nobody). Estimates are
    one trace each, answered in the request; plans are jobs (start_plan)."""
    arguments = checked(app, command_name, body)
    await take_slot(app)
    work = asyncio.ensure_future(_bounded(command_name, arguments, app.state.config))
    try:
        if not await _unless_client_goes(request, work, None):
            log.info("%s stopped: its client went away", command_name)
            raise RequestRefused(f"the client went away; the {command_name} was stopped.", status=499)
        outcome = work.result()
    finally:
        if not work.done():
            work.cancel()  # (its child killed and reaped as it unwinds)
            await asyncio.wait([work])
        app.state.predicting.release()
    return JSONResponse(outcome.document, status_code=outcome.status)


async def start_plan(app, body: object, owner: str, request: Request | None = None) -> tuple[PlanJob, Outcome | None]:
    """`autotune plan` for `body`, checked as the command line checks it, started as a job of
    `owner`'s that holds a slot while its child runs (plans.py), and waited for a while
    (`plan_wait_seconds`): the job, and its outcome where it ended in that time (the job then
    forgotten: its answer is this). A client that goes away meanwhile (`request`) stops it: nobody
    else knows its id."""
    config = app.state.config
    arguments = checked(app, "plan", body)
    await take_slot(app)
    jobs: PlanJobs = app.state.plans
    asked = body if isinstance(body, dict) else {}
    job = jobs.start(
        owner, asked, lambda job: _bounded("plan", arguments, config, job.report), app.state.predicting.release
    )
    ended = asyncio.ensure_future(job.done.wait())
    try:
        present = await _unless_client_goes(request, ended, config.plan_wait_seconds)
    finally:
        ended.cancel()
    if not present and job.outcome is None:
        log.info("plan %s stopped: its client went away", job.id)
        await jobs.stop(job, Outcome.refused(499, "the client went away; the plan was stopped."))
    if job.outcome is not None:
        jobs.forget(job)
        return job, job.outcome
    jobs.touch(job)  # (its client is told where to ask: the time it has to ask starts now)
    return job, None


async def _unless_client_goes(request: Request | None, work: asyncio.Future, timeout: float | None) -> bool:
    """Wait for `work` (at most `timeout` seconds); False where the client went away first."""
    gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
    try:
        done, _ = await asyncio.wait(
            [task for task in (work, gone) if task is not None], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        if gone is not None:
            gone.cancel()
    return work in done or gone not in done


async def _bounded(
    command_name: str, arguments: tuple[str, ...], config, on_progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """_run, held to the service's `predict_seconds` (504 past them: the child killed)."""
    try:
        return await asyncio.wait_for(_run(command_name, arguments, config, on_progress), config.predict_seconds)
    except TimeoutError:
        return Outcome.refused(
            504,
            f"the {command_name} ran past the service's {config.predict_seconds:.0f} s; ask for fewer configurations.",
        )


async def _run(
    command_name: str, arguments: tuple[str, ...], config, on_progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """`autotune COMMAND ARGUMENTS --json` in a child that dies with the service (kill -9 included),
    to its end: its document, or its refusal's line (422), or why it failed (500); its counts of
    traces to `on_progress` as they come (render/live.py's progress lines, read off its stderr).
    Cancelled, the child is killed and reaped before this returns."""
    from autotune.host.processes import kill_me_with_parent
    from autotune.render.live import PROGRESS_ENV, read_progress

    extra = ["--db", config.db] if command_name == "plan" and config.db else []
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "autotune",
        command_name,
        *arguments,
        *extra,
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        preexec_fn=kill_me_with_parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1", PROGRESS_ENV: "1"},
        limit=STDERR_LINE_LIMIT,
    )
    said_lines: list[str] = []

    async def read_stderr() -> None:
        assert child.stderr is not None
        async for raw in child.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            counts = read_progress(line)
            if counts is None:
                said_lines.append(line)
            elif on_progress is not None:
                on_progress(*counts)

    try:
        assert child.stdout is not None
        out, _ = await asyncio.gather(child.stdout.read(), read_stderr())
        await child.wait()
    finally:
        if child.returncode is None:  # (cancelled: stopped, or past its time)
            child.kill()
            await child.wait()
    said = [line for line in said_lines if line.startswith("autotune: error: ")]
    if child.returncode == EXIT_USER_ERROR and said:
        return Outcome.refused(422, said[-1].removeprefix("autotune: error: "))
    try:
        document: Any = json.loads(out)
    except ValueError:
        last = (said or [line for line in said_lines if line.strip()] or ["no output"])[-1]
        return Outcome.refused(500, f"the {command_name} failed (exit {child.returncode}): {last[:300]}")
    return Outcome(200, document)


# The longest stderr line a child's reader takes whole (a traceback's lines are short; a line
# longer than this would end the reading with an error, where 64 KiB is asyncio's default).
STDERR_LINE_LIMIT = 1 << 20


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (polled: Starlette says so only when asked)."""
    while not await request.is_disconnected():
        await asyncio.sleep(CLIENT_POLL_SECONDS)


PLAN_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "The plan, ready within the wait: `autotune plan --json`'s document."},
    202: {
        "description": "Still planning: `Location` (and `links.self`) is where to ask again, every "
        "`Retry-After` seconds; a plan nobody asks about for a minute is stopped.",
        "headers": {
            "Location": {"schema": {"type": "string"}, "description": "/v1/plans/ID"},
            "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds before asking again."},
        },
    },
    401: {"description": "No live token."},
    403: {"description": "A field or a path the operator has not allowed."},
    422: {"description": "A flag the command line would refuse, with its line."},
    503: {"description": "Every prediction slot is busy."},
    504: {"description": "The plan ran past the service's limit."},
}


@router.post(
    "/v1/plan",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "description": "`autotune plan`'s flags (model, gpu or gpu_budget, space flags; "
                        'several cards `gpu: "h100,l4"` or `all`, with `gpus: "1,2,4"` and `tokens: "100M"`).',
                    }
                }
            },
        }
    },
    responses=PLAN_ANSWERS,
)
async def plan(request: Request, who: str = Depends(require_writer)) -> JSONResponse:
    """`autotune plan --json`: every candidate's memory and speed predicted for a card, or with
    several cards and counts which to rent. Answered at once where it is ready within a few seconds
    (200); otherwise `202 Accepted` with where to ask for it (`GET /v1/plans/ID`)."""
    job, outcome = await start_plan(request.app, await json_body(request), who, request)
    if outcome is not None:
        return JSONResponse(outcome.document, status_code=outcome.status)
    return _running(request, job, location=True)


@router.get(
    "/v1/plans/{plan_id}",
    responses={
        200: {"description": "The plan: `autotune plan --json`'s document."},
        202: {"description": "Still planning: its state and time so far; ask again after `Retry-After` seconds."},
        404: {"description": "No such plan for this token (another token's reads as none)."},
        410: {"description": "Stopped: nobody asked about it for a minute."},
        422: {"description": "The command line refused it, with its line."},
        504: {"description": "It ran past the service's limit."},
    },
)
async def read_plan(plan_id: str, request: Request, who: str = Depends(require_writer)) -> JSONResponse:
    """A plan started by POST /v1/plan: 202 while it runs, then its answer as POST would have
    answered it (the plan with 200, or the refusal's status and line). Only the token that asked
    for it reads it; asking keeps it going (one nobody asks about for a minute is stopped)."""
    job = plan_of(request.app, plan_id, who)
    if job.outcome is None:
        return _running(request, job, location=False)
    return JSONResponse(job.outcome.document, status_code=job.outcome.status)


def plan_of(app, plan_id: str, who: str) -> PlanJob:
    """`who`'s plan `plan_id` (404 for none, and for another token's)."""
    try:
        return app.state.plans.get(plan_id, who)
    except PlanNotFound:
        raise RequestRefused(
            f"no plan {plan_id[:40]!r} for this token: a plan is read by the token that asked for it, until "
            f"{PLAN_KEPT_SECONDS / 60:.0f} minutes after it ended; ask for it again.",
            status=404,
        ) from None


def _running(request: Request, job: PlanJob, *, location: bool) -> JSONResponse:
    headers = {"Retry-After": str(PLAN_RETRY_SECONDS)}
    if location:
        headers["Location"] = job.links["self"]
    return JSONResponse(job.view(request.app.state.plans.clock()), status_code=202, headers=headers)


@router.post(
    "/v1/estimate",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "description": "`autotune estimate`'s flags (model, micro_batch, block_size, ...).",
                    }
                }
            },
        }
    },
)
async def estimate(request: Request, _: str = Depends(require_writer)) -> JSONResponse:
    """`autotune estimate --json`: one configuration's training memory, predicted."""
    return await predict_body(request.app, "estimate", await json_body(request), request)
