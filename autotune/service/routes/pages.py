"""The pages: the searches, one search followed live, the plan form and the login form.

Laid out by the Jinja2 templates in service/templates from what views.py says (the API's own words,
said once), with autoescaping on: a template escapes every value it writes, so no string the
database or a client gave reaches a page as markup, and no route has to remember to. The one value
handed over as markup is the plot, which svg.py draws with its own text escaped. StrictUndefined
makes a value a template names but was not given an error, not a blank.

Each page reads without JavaScript; the one script (static/live.js) follows a search's events,
re-reads the page's parts as they change, and copies snippets. Nothing comes from elsewhere: the
style and the script are in static/, and a strict Content-Security-Policy says so to the browser."""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from jinja2.ext import Extension
from markupsafe import Markup
from sqlalchemy.exc import SQLAlchemyError

from autotune.vocabulary.errors import AutotuneError, Conflict, DatabaseError, StudyNotFound
from autotune.render.tables import error_gist, spread_text
from autotune.service.auth import COOKIE, token_holder
from autotune.service.commands import RequestRefused
from autotune.service.plans import PLAN_RETRY_SECONDS, Outcome
from autotune.service.svg import size_text, speed_memory_svg, speed_text, time_cost_svg
from autotune.service.views import (
    cancel_search,
    list_view,
    may_cancel,
    plan_page_view,
    progress_text,
    search_page_view,
    where_text,
)
from autotune.vocabulary.status import SEARCH_ENDED
from autotune.vocabulary.units import format_duration

log = logging.getLogger("autotune.service")

router = APIRouter(tags=["pages"], include_in_schema=False)

LIST_REFRESH_SECONDS = 10
HEADERS = {
    # Everything the pages use is this service's own: no CDN, no inline script or style.
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
# The plan form's fields: /v1/plan's (`autotune plan`'s flags), each with its label, its hint, whether it
# is required, and its choices where it is a select.
PLAN_FIELDS = (
    ("model", "Model", "a hub id, or a directory under the service's model root", True, None),
    ("gpu", "Cards", "h100; or several: h100,a100-80gb,l4; or all", False, None),
    ("gpu_budget", "Budget", "e.g. 8GiB; or leave it out to use the card's memory", False, None),
    ("gpus", "GPUs", "1; or counts to weigh: 1,2,4,8", False, None),
    ("tokens", "Tokens", "the run's, to time and price it: 100M", False, None),
    ("sort", "Sort by", "", False, ("cost", "time")),
)


# -- the templates ------------------------------------------------------------------------------------


class CompactMarkup(Extension):
    """The templates are written an element a line, indented, to be read; the pages go out as compact
    as they were when Python wrote them, with nothing between tags (clients and tests match markup
    such as `<dt>Confirmation</dt><dd>`, and a snippet's `<pre>` holds its text alone). So, in a
    template's own text (never in a value it writes), a line break and the indentation around it
    vanish between two pieces of markup (an HTML tag, or a Jinja tag, expression or comment) and
    read as one space anywhere else, as a browser reads a break within text."""

    BREAK = re.compile(r"\s*\n\s*")
    ENDS = (">", "%}", "}}", "#}")
    STARTS = ("<", "{%", "{{", "{#")

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        def join(found: re.Match[str]) -> str:
            after_markup = found.start() == 0 or source.endswith(self.ENDS, 0, found.start())
            before_markup = found.end() == len(source) or source.startswith(self.STARTS, found.end())
            return "" if after_markup and before_markup else " "

        return self.BREAK.sub(join, source)


def _escaped(value: Any) -> Any:
    """What autoescaping writes for a value: html.escape's entities (&quot; &#x27;), those the pages
    have always sent and clients match, where markupsafe's own would write &#34; &#39; (as safe).
    Markup (a macro's output, the plot) is written as it is; an undefined value still fails here."""
    return value if hasattr(value, "__html__") else Markup(html.escape(str(value)))


TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).resolve().parents[1] / "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    finalize=_escaped,
    extensions=[CompactMarkup],
)
# How the templates write a value: the command line's words for sizes, speeds and errors, and views.py's
# for where a search runs and how far it got, so that a page and `autotune` say them alike.
TEMPLATES.filters.update(
    size=size_text,
    speed=speed_text,
    percent=lambda share: f"{share:.0%}",
    gist=error_gist,
    where=where_text,
    progress=progress_text,
    noise=spread_text,
)


# -- the pages ----------------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def index(request: Request) -> Response:
    """Every search: what, where, its state and progress, its best speed so far."""
    return await _answer(request, _index, reading=True)


@router.get("/searches/{name}", response_class=HTMLResponse)
async def search_page(name: str, request: Request) -> Response:
    """One search: its header, leaderboard, plot, pick with why and hand-off snippets, followed live."""
    return await _answer(request, lambda req, who: _search(req, who, name), reading=True)


@router.post("/searches/{name}/cancel")
async def cancel_from_page(name: str, request: Request) -> Response:
    """The search page's cancel button: the API's cancel (views.cancel_search: only the token that
    submitted it), then back to the page. A cross-site form cannot reach it: the guard (guard.py)
    refuses a cookie's write from any page but this service's own."""
    page = f"/searches/{quote(name, safe='')}"

    def work() -> Response:
        who = token_holder(request)
        if who is None:
            error = _error("cancelling a search needs a token: log in first.", login=page)
            return _render("error.html", "Error", None, status=401, error=error)
        cancel_search(request.app.state.store, name, who)
        return RedirectResponse(page, status_code=303)

    try:
        return await run_in_threadpool(work)
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        return _failure(exc, None)


@router.get("/plan", response_class=HTMLResponse)
async def plan_form(request: Request) -> Response:
    return await _answer(request, lambda req, who: _plan_page({}, who))


@router.post("/plan", response_class=HTMLResponse)
async def plan_submit(request: Request) -> Response:
    """The form's fields as /v1/plan's body, planned by the same machinery (routes/predictions.py:
    the same checks, slots, child and job). Ready within the API's wait: the table shown; otherwise
    on to the plan's own page, which reads itself again until it is (no script needed)."""
    from autotune.service.routes.predictions import start_plan

    form: dict[str, str] = {}
    who = None
    try:
        form = await _form(request)
        who = await run_in_threadpool(token_holder, request)
        if who is None:
            error = _error("predicting needs a token: log in first.", login="/plan")
            return _plan_page(form, who, error=error, status=401)
        body = {key: form[key].strip() for key, *_ in PLAN_FIELDS if form.get(key, "").strip()}
        job, outcome = await start_plan(request.app, body, who, request)
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        status, line = _refusal(exc)
        return _plan_page(form, who, error=_error(line), status=status)
    if outcome is None:
        return RedirectResponse(job.links["page"], status_code=303)
    return _plan_answer(form, who, outcome)


@router.get("/plans/{plan_id}", response_class=HTMLResponse)
async def plan_progress(plan_id: str, request: Request) -> Response:
    """A plan the form started: that it is being worked out (the page reads itself again every few
    seconds: a `<meta http-equiv="refresh">`, no script), then its table, or why there is none. Only
    for the token that asked; reading it keeps it going, as GET /v1/plans/ID does."""
    from autotune.service.routes.predictions import plan_of

    page = f"/plans/{quote(plan_id, safe='')}"
    who = None
    try:
        who = await run_in_threadpool(token_holder, request)
        if who is None:
            error = _error("a plan is shown to the token that asked for it: log in first.", login=page)
            return _plan_page({}, who, error=error, status=401)
        job = plan_of(request.app, plan_id, who)
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        status, line = _refusal(exc)
        return _plan_page({}, who, error=_error(line), status=status)
    form = {
        key: ",".join(map(str, value)) if isinstance(value, list) else str(value) for key, value in job.body.items()
    }
    if job.outcome is None:
        plans = request.app.state.plans
        planning = {
            "elapsed": format_duration(job.elapsed(plans.clock())),
            "idle": format_duration(plans.idle_seconds),
            "traced": None if job.progress is None else f"{job.progress[0]} of {job.progress[1]}",
        }
        return _plan_page(form, who, planning=planning, refresh=PLAN_RETRY_SECONDS)
    return _plan_answer(form, who, job.outcome)


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, next: str = "/") -> Response:
    return await _answer(request, lambda req, who: _render("login.html", "Log in", who, target=_next(next)))


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    """Check the pasted token; keep it in an HttpOnly, SameSite=Strict cookie."""
    try:
        form = await _form(request)
        token = form.get("token", "").strip()
        target = _next(form.get("next", "/"))
        store = request.app.state.store
        name = await run_in_threadpool(store.tokens.holder, token) if token else None
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        return _failure(exc, None)
    if name is None:
        line = "that is not a live token of this service; ask its operator for one (autotune token create NAME)."
        return _render("login.html", "Log in", None, status=401, error=_error(line), target=target)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/", secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


# -- answering: who, errors ---------------------------------------------------------------------------


async def _answer(request: Request, build, *, reading: bool = False) -> Response:
    """`build(request, who)` in a thread (it reads the database), with a reader's check where
    `reading` and a one-line page for a refusal."""

    def work() -> Response:
        who = token_holder(request)
        if reading and who is None and not request.app.state.config.public_read:
            wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/login?next={quote(wanted, safe='')}", status_code=303)
        return build(request, who)

    try:
        return await run_in_threadpool(work)
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        return _failure(exc, None)
    except Exception as exc:  # a bug: logged with its traceback, said in one line
        log.error("error serving %s %s", request.method, request.url.path, exc_info=exc)
        error = _error("the service failed on this page; its log has the details.")
        return _render("error.html", "Error", None, status=500, error=error)


def _refusal(exc: Exception) -> tuple[int, str]:
    """A refused request's status and its one line; the database's own words stay in the log."""
    if isinstance(exc, RequestRefused):
        return exc.status, str(exc)
    if isinstance(exc, DatabaseError) or isinstance(exc, SQLAlchemyError):
        log.warning("database: %s", exc.__class__.__name__, exc_info=exc)
        return 503, "the results database cannot be reached now; try again shortly."
    return 404 if isinstance(exc, StudyNotFound) else 409 if isinstance(exc, Conflict) else 422, str(exc)


def _failure(exc: Exception, who: str | None) -> HTMLResponse:
    status, line = _refusal(exc)
    return _render("error.html", "Error", who, status=status, error=_error(line))


def _error(line: str, login: str | None = None) -> dict[str, str | None]:
    """A failure as a page says it: its first line, and where logging in would let it go on."""
    first = (line.strip().splitlines() or ["failed"])[0]
    return {"line": first, "login": f"/login?next={quote(login, safe='')}" if login else None}


async def _form(request: Request) -> dict[str, str]:
    """A form-encoded body's fields (the last of each)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise RequestRefused(
            "send the form as application/x-www-form-urlencoded (the page's own form does).", status=415
        )
    try:
        text = (await request.body()).decode("utf-8")
    except UnicodeDecodeError:
        raise RequestRefused("the form is not UTF-8 text.") from None
    return {key: values[-1] for key, values in parse_qs(text, keep_blank_values=True).items()}


def _next(target: str) -> str:
    """Where to go after logging in: a path on this service only."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target or any(c < " " for c in target):
        return "/"
    return target


# -- each page's values -------------------------------------------------------------------------------


def _index(request: Request, who: str | None) -> Response:
    store = request.app.state.store
    searches = list_view(store, request.app.state.config.page_size)
    active = any(search["state"] not in SEARCH_ENDED for search in searches)
    workers = [worker.to_dict() | {"describe": worker.device.describe()} for worker in store.workers.connected()]
    refresh = LIST_REFRESH_SECONDS if active else None
    return _render("index.html", "Searches", who, refresh=refresh, searches=searches, workers=workers)


def _search(request: Request, who: str | None, name: str) -> Response:
    page = search_page_view(request.app.state.store, name)
    search = page["search"]
    # Markup, written as it is: svg.py escapes its own text (the labels and sizes in each tip and line's
    # title, config labels from the database among them); the rest it writes is numbers and fixed words.
    plot = Markup(speed_memory_svg(search["leaderboard"], search["budget_bytes"], page["margin_bytes"]))
    live = {"events": search["links"]["events"], "ended": search["state"] in SEARCH_ENDED}
    return _render("search.html", search["name"], who, live=live, plot=plot, may_cancel=may_cancel(search, who), **page)


def _plan_answer(form: dict[str, str], who: str | None, outcome: Outcome) -> HTMLResponse:
    """A plan's outcome under the form: its table (one card's, or which card to rent with its
    plot), or its refusal's line with its status."""
    if outcome.status != 200:
        line = str(outcome.document.get("error", "the plan failed"))
        return _plan_page(form, who, error=_error(line), status=outcome.status)
    return _plan_page(form, who, plan=plan_page_view(outcome.document))


def _plan_page(
    form: dict[str, str],
    who: str | None,
    *,
    plan: dict[str, Any] | None = None,
    planning: dict[str, str] | None = None,
    refresh: int | None = None,
    error: dict[str, str | None] | None = None,
    status: int = 200,
) -> HTMLResponse:
    """The plan form, keeping what was asked, and under it the prediction, that it is being worked
    out, or why there is none."""
    fields = [
        {
            "key": key,
            "label": label,
            "hint": hint,
            "required": required,
            "choices": choices,
            "value": form.get(key, ""),
        }
        for key, label, hint, required, choices in PLAN_FIELDS
    ]
    # Markup, written as it is: svg.py escapes its own text (each card's label and config in tips and names).
    plot = Markup(time_cost_svg(plan["rows"])) if plan is not None and plan["kind"] == "rentals" else None
    return _render(
        "plan.html",
        "Plan",
        who,
        status=status,
        error=error,
        refresh=refresh,
        fields=fields,
        plan=plan,
        plot=plot,
        planning=planning,
    )


def _render(
    template: str,
    title: str,
    who: str | None,
    *,
    status: int = 200,
    error: dict[str, str | None] | None = None,
    live: dict[str, Any] | None = None,
    refresh: int | None = None,
    **values: Any,
) -> HTMLResponse:
    """A page: `template` in the frame every page shares (base.html), with the headers every page sends.
    The frame's values are always given, none where a page has none, for StrictUndefined."""
    text = TEMPLATES.get_template(template).render(
        title=title, who=who, error=error, live=live, refresh=refresh, **values
    )
    return HTMLResponse(text, status_code=status, headers=HEADERS)
