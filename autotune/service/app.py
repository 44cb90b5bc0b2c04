"""The FastAPI application: one store (the commands' database) opened for the process, the limits
every request is held to (body size, open event streams, predictions at once), and one way of
saying a refusal: a status and `{"error": "one line"}`, never a traceback. Routes live in routes/,
one module per resource; each calls the function its command calls."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from autotune.vocabulary.errors import AutotuneError, Conflict, DatabaseError, StudyNotFound
from autotune.service.commands import RequestRefused
from autotune.service.guard import RequestGuard
from autotune.service.plans import PLAN_IDLE_SECONDS, PLAN_WAIT_SECONDS, PlanJobs
from autotune.service.submissions import ServicePolicy
from autotune.vocabulary.version import __version__

log = logging.getLogger("autotune.service")

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """How the service is run (autotune serve's flags)."""

    db: str | None = None
    policy: ServicePolicy = field(default_factory=ServicePolicy)
    public_read: bool = False
    max_body_bytes: int = 64 * 1024  # a search's flags fit in a few hundred bytes
    max_streams: int = 256  # event streams open at once
    stream_seconds: float = 3600.0  # one stream's life; a follower reconnects with Last-Event-ID
    poll_seconds: float = 0.5  # how often a stream looks for new events
    token_recheck_seconds: float = 5.0  # how often an open stream checks its token is still live
    predict_slots: int = 1  # plans and estimates traced at once (each takes cores)
    predict_seconds: float = 900.0  # one plan or estimate, at most
    plan_wait_seconds: float = PLAN_WAIT_SECONDS  # a plan not ready in this long is answered 202 (plans.py)
    plan_idle_seconds: float = PLAN_IDLE_SECONDS  # a running plan nobody asks about for this long is stopped
    page_size: int = 200  # searches listed at most
    allowed_hosts: frozenset[str] | None = None  # the Host names answered (guard.py); None: any


def create_app(config: ServiceConfig, store=None) -> FastAPI:
    """The application over `config.db` (or an open `store`, which the caller closes)."""
    from autotune.service.routes import answers, pages, predictions, searches

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from autotune.store import open_store

        own = store is None
        app.state.store = open_store(config.db) if own else store
        try:
            yield
        finally:
            await app.state.plans.close()  # (each running plan's child killed, not left to trace for nobody)
            if own:
                app.state.store.close()

    # No /docs or /redoc: FastAPI serves them from a CDN, and every page here works offline.
    app = FastAPI(
        title="autotune",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        description="Find the fastest training configuration that fits a GPU's memory, by measuring it: "
        "submit searches, follow them, and take their answers.",
    )
    app.state.config = config
    app.state.streams = asyncio.Semaphore(config.max_streams)
    app.state.predicting = asyncio.Semaphore(config.predict_slots)
    app.state.plans = PlanJobs(idle_seconds=config.plan_idle_seconds)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(RequestGuard, hosts=config.allowed_hosts)  # (outermost: before any body is read)
    for router in (searches.router, answers.router, predictions.router, pages.router):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _errors(app)
    return app


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestRefused)
    async def refused(request: Request, exc: RequestRefused) -> JSONResponse:
        return error(exc.status, str(exc))

    @app.exception_handler(AutotuneError)
    async def autotune_error(request: Request, exc: AutotuneError) -> JSONResponse:
        if isinstance(exc, DatabaseError):
            log.warning("database: %s", exc)
            return error(503, f"the results database cannot be used now: {exc}")
        status = 404 if isinstance(exc, StudyNotFound) else 409 if isinstance(exc, Conflict) else 422
        return error(status, str(exc))

    @app.exception_handler(SQLAlchemyError)
    async def database_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        log.warning("database: %s", exc.__class__.__name__, exc_info=exc)
        return error(503, "the results database cannot be reached now; try again shortly (the service's log says why).")

    # (Starlette's own: routing's 404 and 405 too, which FastAPI's subclass handler would miss.)
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header"))
        return error(422, f"{where or 'request'}: {first.get('msg', 'not valid')}")

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error(500, "the service failed on this request; its log has the details.")


class BodyLimit:
    """Refuse a request body over `max_bytes` (413), by its Content-Length or as it streams in."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await error(
                413,
                f"the request body is over {self.max_bytes:,} bytes; a request is a command's "
                f"flags, which fit in far less.",
            )(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        try:
            return await self.app(scope, limited, send)
        except BodyTooLarge:
            return await error(413, f"the request body is over {self.max_bytes:,} bytes.")(scope, receive, send)


class BodyTooLarge(Exception):
    pass
