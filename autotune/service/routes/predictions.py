"""/v1/plan and /v1/estimate: the predictions, without a GPU. The body is the command's flags (the
table of its flags, autotune/flags/table.py); the command runs in a child process, `--json`, as a user's shell would
run it (its traces in their own processes, its cache shared), a few at a time, each held to a limit."""

from __future__ import annotations

import asyncio
import logging
import json
import os
import sys
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from autotune.vocabulary.errors import EXIT_USER_ERROR
from autotune.service.auth import require_writer
from autotune.service.commands import RequestRefused, read_request
from autotune.service.routes.searches import json_body

router = APIRouter(tags=["predictions"])
log = logging.getLogger("autotune.service")

SLOT_WAIT_SECONDS = 30.0
CLIENT_POLL_SECONDS = 0.5


async def predict(request: Request, command_name: str) -> JSONResponse:
    return await predict_body(request.app, command_name, await json_body(request), request)


async def predict_body(app, command_name: str, body: object, request: Request | None = None) -> JSONResponse:
    """A plan or estimate for `body` (the command's flags): checked, then run in a child, a few at a
    time, stopped when its client goes away (`request`: it would hold a slot for nobody). The /plan
    page's form comes here too."""
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
    slots: asyncio.Semaphore = app.state.predicting
    try:
        await asyncio.wait_for(slots.acquire(), SLOT_WAIT_SECONDS)
    except TimeoutError:
        raise RequestRefused(
            f"the service is busy predicting (at most {config.predict_slots} at once); try again shortly.", status=503
        ) from None
    try:
        return await _run(command_name, parsed.arguments, config, request)
    finally:
        slots.release()


async def _run(command_name: str, arguments: tuple[str, ...], config, request: Request | None) -> JSONResponse:
    """`autotune COMMAND ARGUMENTS --json` in a child that dies with the service, and is stopped
    when its client goes away or its time is up."""
    from autotune.host.processes import kill_me_with_parent

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
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    talk = asyncio.ensure_future(child.communicate())
    gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
    try:
        done, _ = await asyncio.wait(
            [task for task in (talk, gone) if task is not None],
            timeout=config.predict_seconds,
            return_when=asyncio.FIRST_COMPLETED,
        )
    except asyncio.CancelledError:
        done = set()
    finally:
        if gone is not None:
            gone.cancel()
    if talk not in done:
        child.kill()
        await child.wait()
        talk.cancel()
        if gone is not None and gone in done:
            log.info("%s stopped: its client went away", command_name)
            raise RequestRefused(f"the client went away; the {command_name} was stopped.", status=499)
        raise RequestRefused(
            f"the {command_name} ran past the service's {config.predict_seconds:.0f} s; ask for fewer configurations.",
            status=504,
        )
    out, err = talk.result()
    said = [line for line in err.decode(errors="replace").splitlines() if line.startswith("autotune: error: ")]
    if child.returncode == EXIT_USER_ERROR and said:
        raise RequestRefused(said[-1].removeprefix("autotune: error: "))
    try:
        document: Any = json.loads(out)
    except ValueError:
        last = (said or err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return JSONResponse(
            {"error": f"the {command_name} failed (exit {child.returncode}): {last[:300]}"}, status_code=500
        )
    return JSONResponse(document)


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (polled: Starlette says so only when asked)."""
    while not await request.is_disconnected():
        await asyncio.sleep(CLIENT_POLL_SECONDS)


@router.post(
    "/v1/plan",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "description": "`autotune plan`'s flags (model, gpu or gpu_budget, space flags).",
                    }
                }
            },
        }
    },
)
async def plan(request: Request, _: str = Depends(require_writer)) -> JSONResponse:
    """`autotune plan --json`: every candidate's memory and speed predicted for a card."""
    return await predict(request, "plan")


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
    return await predict(request, "estimate")
