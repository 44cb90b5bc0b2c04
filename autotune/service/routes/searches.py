"""/v1/searches: submit a search (queued for a worker), list and read them, cancel one, follow its
events, take its answer. Each route reads or writes through the store and says what views.py says."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from autotune.service.auth import require_reader, require_writer, token_holder
from autotune.flags.table import SEARCH
from autotune.host.config_files import json_shape_problem
from autotune.service.commands import RequestRefused, fields
from autotune.service.submissions import ServicePolicy, submission_of
from autotune.service.views import (
    best_response,
    cancel_search,
    EventReader,
    links,
    progress_text,
    search_view,
)
from autotune.vocabulary.status import SEARCH_ENDED

router = APIRouter(tags=["searches"])

IDEMPOTENCY_KEY_MAX = 255
KEEPALIVE_SECONDS = 15.0


def search_body_schema() -> dict[str, Any]:
    """The body's JSON schema, derived from the table of `autotune search`'s flags (flags/table.py)."""
    value: dict[str, Any] = {
        "anyOf": [
            {"type": "string"},
            {"type": "number"},
            {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "number"}]}},
        ]
    }
    properties: dict[str, Any] = {}
    for name, row in fields(SEARCH).items():
        if name == "device":
            continue
        schema: dict[str, Any] = {"type": "boolean"} if row.switch or row.negatable else dict(value)
        schema["description"] = row.help.split("\n")[0][:300]
        properties[name] = schema
    properties["device"] = {
        "type": "string",
        "enum": ["auto", "cuda", "cpu"],
        "description": "The device kind of the workers that may run it [default: cuda].",
    }
    properties["gpu"] = {"type": "string", "description": "A card's name the worker's device must carry (e.g. A10G)."}
    return {
        "type": "object",
        "required": ["model", "gpu_budget"],
        "properties": properties,
        "additionalProperties": False,
    }


# A request body is a command's flags: a flat object whose values are strings, numbers or lists.
MAX_BODY_DEPTH = 8
MAX_BODY_VALUES = 10_000  # (no flag takes more than 256 values)


async def json_body(request: Request) -> object:
    """The body as JSON, refused (422, one line) where it is not, nests deeper than any flags do,
    or holds a string that is not text (a lone surrogate: `"\\ud800"` is valid JSON, not Unicode)."""
    try:
        document = json.loads(await request.body() or b"null")
    except (ValueError, UnicodeDecodeError):
        raise RequestRefused("the request body is not JSON; send a JSON object of `autotune search`'s flags.") from None
    except RecursionError:
        raise RequestRefused(f"the request body nests deeper than {MAX_BODY_DEPTH} levels; flags do not.") from None
    _check_json(document)
    return document


def _check_json(document: object) -> None:
    problem = json_shape_problem(document, max_depth=MAX_BODY_DEPTH, max_values=MAX_BODY_VALUES)
    if problem == "depth":
        raise RequestRefused(f"the request body nests deeper than {MAX_BODY_DEPTH} levels; flags do not.")
    if problem == "values":
        raise RequestRefused(f"the request body holds more than {MAX_BODY_VALUES:,} values; flags do not.")
    if problem == "text":
        raise RequestRefused(
            "the request body holds a string that is not text (a lone UTF-16 surrogate escape); send UTF-8 text."
        )


@router.post(
    "/v1/searches",
    status_code=202,
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": search_body_schema()}}}
    },
    responses={
        202: {"description": "Queued (or the same request's search, as it stands)."},
        401: {"description": "No live token."},
        409: {"description": "The name is taken by other settings."},
        422: {"description": "A flag the command line would refuse, with its line."},
    },
)
async def submit(
    request: Request,
    who: str = Depends(require_writer),
    idempotency_key: str | None = Header(default=None, max_length=IDEMPOTENCY_KEY_MAX),
) -> JSONResponse:
    """Queue a search: what `autotune search` takes, checked as it checks it. The same request again
    (or the same Idempotency-Key) answers with the same search."""
    body = await json_body(request)
    policy: ServicePolicy = request.app.state.config.policy
    submission = await run_in_threadpool(submission_of, body, policy)
    store = request.app.state.store
    record, created = await run_in_threadpool(
        lambda: store.queue.submit(submission, idempotency_key=idempotency_key, submitted_by=who)
    )
    view = await run_in_threadpool(search_view, store, record.name, detail=False)
    view["created"] = created
    return JSONResponse(view, status_code=201 if created else 200, headers={"Location": links(record.name)["self"]})


@router.get("/v1/searches")
def list_searches(
    request: Request, limit: int = Query(default=100, ge=1, le=1000), _: str | None = Depends(require_reader)
) -> dict[str, Any]:
    """Every search: submitted ones and the command line's studies, newest first."""
    from autotune.service.views import list_view

    return {"searches": list_view(request.app.state.store, min(limit, request.app.state.config.page_size))}


@router.get("/v1/workers")
def list_workers(request: Request, _: str | None = Depends(require_reader)) -> dict[str, Any]:
    """The queue workers connected now (heard within the queue's stale time): what each can serve."""
    return {"workers": [worker.to_dict() for worker in request.app.state.store.workers.connected()]}


@router.get("/v1/searches/{name}")
def read_search(name: str, request: Request, _: str | None = Depends(require_reader)) -> dict[str, Any]:
    """A search's state (with the reason), progress, leaderboard, and the pick with why."""
    return search_view(request.app.state.store, name)


@router.post("/v1/searches/{name}/cancel", status_code=202)
def cancel(name: str, request: Request, who: str = Depends(require_writer)) -> dict[str, Any]:
    """Stop a search: its probe in flight is ended, nothing is left running, and submitting it
    again resumes it. Only the token that submitted it may (a search submitted before tokens were
    recorded: any token)."""
    return cancel_search(request.app.state.store, name, who)


@router.get("/v1/searches/{name}/best")
def best(
    name: str, request: Request, format: str = Query(default="json"), _: str | None = Depends(require_reader)
) -> Response:
    """Exactly what `autotune best --study NAME --format FORMAT` prints; its notes in
    `Autotune-Note` headers."""
    from autotune.flags.table import BEST_FORMATS
    from autotune.handoff.best_config import best_in

    if format not in BEST_FORMATS:
        raise RequestRefused(f"format {format[:40]!r}: give one of {', '.join(BEST_FORMATS)}.")
    return best_response(best_in(request.app.state.store, name), format)


@router.get(
    "/v1/searches/{name}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "Server-sent events: `probe` (one per configuration settled), `state`, `end`.",
        }
    },
)
async def events(
    name: str,
    request: Request,
    _: str | None = Depends(require_reader),
    last_event_id: str | None = Header(default=None, max_length=20),
) -> StreamingResponse:
    """One event per probe settled (the line the command line prints, and its figures), from the
    start or after `Last-Event-ID`; `state` when the state changes; `end` when the search ends."""
    store = request.app.state.store
    config = request.app.state.config
    view = await run_in_threadpool(search_view, store, name, detail=False)
    after = 0
    if last_event_id is not None:
        if not re.fullmatch(r"[0-9]{1,18}", last_event_id.strip(), re.ASCII):
            raise RequestRefused(
                f"Last-Event-ID {last_event_id[:20]!r} is not an event id (a whole number, at most 18 digits)."
            )
        after = int(last_event_id)
    slots: asyncio.Semaphore = request.app.state.streams
    if slots.locked():
        raise RequestRefused(
            f"{config.max_streams} event streams are open, as many as this service allows; try again shortly.",
            status=503,
        )
    await slots.acquire()
    # (A study searched from the command line stores no count of its candidates: those settled so far.)
    reader = EventReader(name, view["progress"]["total"] or view["progress"]["settled"])

    async def stream():
        try:
            if after:
                await run_in_threadpool(reader.skip_to, store, after)
            yield "retry: 2000\n\n"
            state, said = None, time.monotonic()
            ends = time.monotonic() + config.stream_seconds
            checked = time.monotonic()
            while not await request.is_disconnected():
                if not config.public_read and time.monotonic() - checked > config.token_recheck_seconds:
                    # A token revoked while its stream is open ends the stream, as it ends the next request.
                    checked = time.monotonic()
                    if await run_in_threadpool(token_holder, request) is None:
                        gone = {"error": "the token of this stream is no longer live; the stream ends."}
                        yield f"event: error\ndata: {json.dumps(gone)}\n\n"
                        return
                found = await run_in_threadpool(reader.read, store)
                for event_id, data in found:
                    yield f"id: {event_id}\nevent: probe\ndata: {json.dumps(data)}\n\n"
                now = await run_in_threadpool(_state, store, name)
                if now != state:
                    state = now
                    yield f"event: state\ndata: {json.dumps(state)}\n\n"
                if state["ended"]:
                    for event_id, data in await run_in_threadpool(reader.read, store):
                        yield f"id: {event_id}\nevent: probe\ndata: {json.dumps(data)}\n\n"
                    yield f"event: end\ndata: {json.dumps(state)}\n\n"
                    return
                if time.monotonic() > ends:
                    yield "event: reconnect\ndata: {}\n\n"
                    return
                if found:
                    said = time.monotonic()
                elif time.monotonic() - said > KEEPALIVE_SECONDS:
                    said = time.monotonic()
                    yield ": keep-alive\n\n"
                await asyncio.sleep(config.poll_seconds)
        except Exception as exc:  # the database went away mid-stream: said as an event, then the stream ends
            yield f"event: error\ndata: {json.dumps({'error': str(exc).splitlines()[0][:300]})}\n\n"
        finally:
            slots.release()

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _state(store, name: str) -> dict[str, Any]:
    """A search's state as its event stream says it (views.search_view's words): the state, the
    reason, what it waits for or which worker holds it, its progress in words, whether it ended."""
    view = search_view(store, name, detail=False)
    return {
        "state": view["state"],
        "reason": view["reason"],
        "waiting": view["waiting"],
        "held_by": view["held_by"],
        "progress": progress_text(view["progress"]),
        "ended": view["state"] in SEARCH_ENDED,
    }
