"""The pages: the searches, one search followed live, the plan form and the login form.

Rendered here, in Python, from what views.py says (the API's own words, said once), with every
string the database or a client gave escaped. Each page reads without JavaScript; the one script
(static/live.js) follows a search's events, re-reads the page's parts as they change, and copies
snippets. Nothing comes from elsewhere: the style and the script are in static/, and a strict
Content-Security-Policy says so to the browser."""

from __future__ import annotations

import json
import logging
from html import escape
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.exc import SQLAlchemyError

from autotune.errors import AutotuneError, Conflict, DatabaseError, StudyNotFound
from autotune.service.auth import COOKIE, token_holder
from autotune.service.commands import RequestRefused
from autotune.service.svg import size_text as _size, speed_memory_svg, speed_text as _speed
from autotune.status import SEARCH_ENDED

log = logging.getLogger("autotune.service")

router = APIRouter(tags=["pages"], include_in_schema=False)

HANDOFF_FORMATS = ("trainer-args", "cli", "accelerate")
LIST_REFRESH_SECONDS = 10
HEADERS = {
    # Everything the pages use is this service's own: no CDN, no inline script or style.
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
PLAN_FIELDS = (
    ("model", "Model", "a hub id, or a directory under the service's model root", True),
    ("gpu", "Card", "a card's name, e.g. h100 or A10G", False),
    ("gpu_budget", "Budget", "e.g. 8GiB; or leave it out to use the card's memory", False),
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


@router.get("/plan", response_class=HTMLResponse)
async def plan_form(request: Request) -> Response:
    return await _answer(request, lambda req, who: _page("Plan", _plan_form({}, who), who))


@router.post("/plan", response_class=HTMLResponse)
async def plan_submit(request: Request) -> Response:
    """The form's fields as /v1/plan's body, predicted by the same machinery; the table shown."""
    form: dict[str, str] = {}
    who = None
    try:
        form = await _form(request)
        who = await run_in_threadpool(token_holder, request)
        if who is None:
            return _page(
                "Plan",
                _plan_form(form, who) + _error_line("predicting needs a token: log in first.", login="/plan"),
                who,
                status=401,
            )
        body = {key: form[key].strip() for key, *_ in PLAN_FIELDS if form.get(key, "").strip()}
        document = await _predict_plan(request, body)
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        return _failure(exc, who, title="Plan", before=_plan_form(form, who))
    return _page("Plan", _plan_form(form, who) + _plan_table(document), who)


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, next: str = "/") -> Response:
    return await _answer(request, lambda req, who: _page("Log in", _login_form(_next(next)), who))


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    """Check the pasted token; keep it in an HttpOnly, SameSite=Strict cookie."""
    try:
        form = await _form(request)
        token = form.get("token", "").strip()
        target = _next(form.get("next", "/"))
        store = request.app.state.store
        name = await run_in_threadpool(store.token_name, token) if token else None
    except (RequestRefused, AutotuneError, SQLAlchemyError) as exc:
        return _failure(exc, None)
    if name is None:
        line = "that is not a live token of this service; ask its operator for one (autotune token create NAME)."
        return _page("Log in", _login_form(target) + _error_line(line), None, status=401)
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
        return _page(
            "Error", _error_line("the service failed on this page; its log has the details."), None, status=500
        )


def _failure(exc: Exception, who: str | None, *, title: str = "Error", before: str = "") -> HTMLResponse:
    if isinstance(exc, RequestRefused):
        status, line = exc.status, str(exc)
    elif isinstance(exc, DatabaseError) or isinstance(exc, SQLAlchemyError):
        log.warning("database: %s", exc.__class__.__name__, exc_info=exc)
        status, line = 503, "the results database cannot be reached now; try again shortly."
    else:
        status = 404 if isinstance(exc, StudyNotFound) else 409 if isinstance(exc, Conflict) else 422
        line = str(exc)
    return _page(title, before + _error_line(line), who, status=status)


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


# -- the index ----------------------------------------------------------------------------------------


def _index(request: Request, who: str | None) -> Response:
    from autotune.service.views import list_view

    config = request.app.state.config
    views = list_view(request.app.state.store, config.page_size)
    if not views:
        body = (
            '<h1>Searches</h1><p class="empty">No searches yet. Submit one with <code>POST /v1/searches</code> '
            "(a JSON object of <code>autotune search</code>'s flags), or run <code>autotune search</code> against "
            "this database.</p>"
        )
        return _page("Searches", body, who)
    rows = []
    for view in views:
        rows.append(
            "<tr>"
            f'<td><a href="{escape(view["links"]["page"])}">{escape(view["name"])}</a></td>'
            f'<td class="model">{escape(str(view["model"] or "-"))}</td>'
            f'<td class="num">{escape(_size(view["budget_bytes"]))}</td>'
            f"<td>{escape(_where(view))}</td>"
            f"<td>{_state(view)}</td>"
            f'<td class="num">{escape(_progress(view["progress"]))}</td>'
            f'<td class="num">{escape(_speed(view["best_tokens_per_s"]))}</td>'
            "</tr>"
        )
    active = any(view["state"] not in SEARCH_ENDED for view in views)
    body = (
        '<h1>Searches</h1><table class="searches"><thead><tr><th>Search</th><th>Model</th><th>Budget</th>'
        "<th>Card / device</th><th>State</th><th>Progress</th><th>Best tokens/s</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    if active:
        body += f'<p class="note">Searches are running: this list is read again every {LIST_REFRESH_SECONDS} s.</p>'
    return _page("Searches", body, who, refresh=LIST_REFRESH_SECONDS if active else None)


# -- one search -----------------------------------------------------------------------------------------


def _search(request: Request, who: str | None, name: str) -> Response:
    from autotune.service.views import EventReader, search_view, study_or_none

    store = request.app.state.store
    view = search_view(store, name)
    study = study_or_none(store, name)
    events = EventReader(name, view["progress"]["total"]).read(store) if study is not None else []
    margin = study.margin_bytes if study is not None else None
    board = view["leaderboard"]
    body = (
        f"<h1>{escape(view['name'])}</h1>"
        + _summary(view, margin)
        + '<section id="results">'
        + _leaderboard(board)
        + speed_memory_svg(board, view["budget_bytes"], margin)
        + "</section>"
        + _events(events)
        + _pick(store, view)
    )
    ended = view["state"] in SEARCH_ENDED
    live = {"data-events": view["links"]["events"], "data-ended": "true" if ended else "false"}
    return _page(view["name"], body, who, live=live)


def _summary(view: dict[str, Any], margin: int | None) -> str:
    progress = view["progress"]
    total = progress["total"]
    meter = (
        f' <progress id="progress-bar" max="{int(total)}" value="{int(progress["settled"])}"></progress>'
        if total
        else ""
    )
    budget = _size(view["budget_bytes"])
    if margin is not None:
        budget += f" (margin {_size(margin)} kept free)"
    reason = view.get("reason") or ""
    rows = [
        ("Model", f'<span class="model">{escape(str(view["model"] or "-"))}</span>'),
        ("Budget", escape(budget)),
        ("Device", escape(_where(view))),
        ("State", f'{_state(view, with_reason=False)} <span id="reason">{escape(reason)}</span>'),
        ("Progress", f'<span id="progress">{escape(_progress(progress))}</span>{meter}'),
    ]
    if progress.get("confirming"):
        windows = int(progress["confirming"])
        rows.append(
            (
                "Confirmation",
                f"{windows} more window{'s' if windows != 1 else ''} of the contenders, measured "
                f"again: probes beyond the configurations settled",
            )
        )
    if view.get("submitted_by"):
        rows.append(("Submitted by", escape(str(view["submitted_by"]))))
    items = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in rows)
    return f'<dl id="summary" class="summary">{items}</dl><p id="live-status" class="note" hidden></p>'


def _leaderboard(board: list[dict[str, Any]]) -> str:
    from autotune.budget import Budget, required_bytes

    rows = []
    for row in board:
        need = required_bytes(row["peak_reserved_bytes"], row["context_bytes"])
        allowed = (
            Budget(row["budget_bytes"], row["margin_bytes"]).allowed_bytes
            if row["budget_bytes"] and row["margin_bytes"] is not None
            else None
        )
        share = f" ({need / allowed:.0%})" if need is not None and allowed else ""
        best = ' class="best"' if row["rank"] == 1 else ""
        rows.append(
            f'<tr data-key="{escape(row["config_key"])}"{best}>'
            f'<td class="num">{int(row["rank"])}</td><td class="label">{escape(row["label"])}</td>'
            f'<td class="num">{escape(_speed(row["tokens_per_s"]))}</td>'
            f'<td class="num">{escape(_size(row["peak_reserved_bytes"]))}</td>'
            f'<td class="num">{escape(_size(need))} of {escape(_size(allowed))}{share}</td></tr>'
        )
    empty = "" if rows else '<tr class="empty"><td colspan="5">Nothing measured fits yet.</td></tr>'
    return (
        '<div id="leaderboard"><h2>Leaderboard</h2><table class="leaderboard"><thead><tr><th>Rank</th>'
        "<th>Config</th><th>Tokens/s</th><th>Peak reserved</th><th>Needs of what the budget allows</th></tr>"
        f"</thead><tbody>{''.join(rows)}{empty}</tbody></table></div>"
    )


def _events(events: list[tuple[int, dict[str, Any]]]) -> str:
    rows = "".join(_event_row(data) for _, data in events)
    return (
        '<section id="probes"><h2>Probes as they settled</h2><table class="events"><thead><tr><th>#</th>'
        "<th>Config</th><th>Status</th><th>Tokens/s</th><th>Needs</th><th>Note</th></tr></thead>"
        f'<tbody id="events">{rows}</tbody></table></section>'
    )


def _event_row(data: dict[str, Any]) -> str:
    """A probe event as a row; live.js builds the same row from the same fields."""
    from autotune.report import error_gist

    need = data["need_bytes"]
    status = str(data["status"])
    note = "best so far" if data["best"] else error_gist(data["error"]) if data["error"] else ""
    return (
        f'<tr data-id="{int(data["id"])}" class="status-{escape(status)}" title="{escape(data["line"])}">'
        f'<td class="num">{int(data["settled"])}/{int(data["total"])}</td>'
        f'<td class="label">{escape(data["label"])}</td><td>{escape(status)}</td>'
        f'<td class="num">{escape(_speed(data["tokens_per_s"]))}</td>'
        f'<td class="num">{escape(_size(need))}</td><td>{escape(note)}</td></tr>'
    )


def _pick(store, view: dict[str, Any]) -> str:
    from autotune.handoff.best_config import best_in

    why = view.get("why")
    parts = ['<div id="pick"><h2>The pick</h2>']
    if why:
        parts.append(f'<pre class="why">{escape(why)}</pre>')
    if not view.get("best"):
        if not why:
            parts.append('<p class="empty">No pick yet: it is said here when a configuration fits.</p>')
        parts.append("</div>")
        return "".join(parts)
    chosen = best_in(store, view["name"])
    for fmt in HANDOFF_FORMATS:  # the text /v1/searches/NAME/best?format=FMT answers with
        ident = f"handoff-{fmt}"
        raw = f"{view['links']['best']}?format={quote(fmt)}"
        parts.append(
            f'<div class="snippet"><h3>{escape(fmt)} <a class="raw" href="{escape(raw)}">raw</a> '
            f'<button type="button" class="copy" data-copy="{ident}">Copy</button></h3>'
            f'<pre id="{ident}">{escape(chosen.render(fmt))}</pre></div>'
        )
    parts.append("</div>")
    return "".join(parts)


# -- the plot: tokens/s against memory needed, with what the budget allows --------------------------------

# -- plan ----------------------------------------------------------------------------------------------


async def _predict_plan(request: Request, body: dict[str, str]) -> dict[str, Any]:
    """`body` as /v1/plan takes it, through the same checks, slots and child (predictions.py)."""
    from autotune.service.routes.predictions import predict_body

    response = await predict_body(request.app, "plan", body)
    document = json.loads(bytes(response.body))
    if response.status_code != 200:
        raise RequestRefused(str(document.get("error", "the plan failed")), status=response.status_code)
    return document


def _plan_form(form: dict[str, str], who: str | None) -> str:
    fields = []
    for key, label, hint, required in PLAN_FIELDS:
        value = escape(form.get(key, ""))
        fields.append(
            f'<label>{label} <input name="{key}" value="{value}" placeholder="{escape(hint)}"'
            f"{' required' if required else ''}></label>"
        )
    login = (
        "" if who else ' <span class="note">(predicting needs a token: <a href="/login?next=%2Fplan">log in</a>)</span>'
    )
    return (
        "<h1>Plan</h1><p>Every candidate's memory and speed predicted for a card, without a GPU "
        "(<code>autotune plan</code>). Give a card, a budget, or both.</p>"
        f'<form method="post" action="/plan" class="plan">{"".join(fields)}'
        f'<button type="submit">Predict</button>{login}</form>'
    )


def _plan_table(document: dict[str, Any]) -> str:
    candidates = document.get("candidates") or []
    rows = []
    for candidate in candidates:
        fits = candidate.get("fits")
        verdict = "fits" if fits else "over" if fits is False else "-"
        rows.append(
            f'<tr class="{"fits" if fits else "over"}"><td class="label">{escape(str(candidate.get("label")))}</td>'
            f'<td>{verdict}</td><td class="num">{escape(_size(candidate.get("need_bytes")))}</td>'
            f'<td class="num">{escape(_speed(candidate.get("tokens_per_s")))}</td>'
            f"<td>{escape(str(candidate.get('why_not') or ''))}</td></tr>"
        )
    fitting = sum(1 for c in candidates if c.get("fits"))
    notes = "".join(f"<li>{escape(str(note))}</li>" for note in document.get("notes") or [])
    notes = f'<ul class="notes">{notes}</ul>' if notes else ""
    allowed = (document.get("budget_bytes") or 0) - (document.get("margin_bytes") or 0)
    return (
        f'<section id="plan-result"><h2>{escape(str(document.get("model")))} on {escape(str(document.get("target")))}</h2>'
        f"<p>{fitting} of {len(candidates)} candidates predicted to fit in {escape(_size(allowed or None))} "
        f"(the budget less its margin).</p>{notes}"
        '<table class="plan"><thead><tr><th>Config</th><th>Fits</th><th>Needs</th><th>Tokens/s (predicted)</th>'
        f"<th>Note</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


# -- login ---------------------------------------------------------------------------------------------


def _login_form(target: str) -> str:
    return (
        "<h1>Log in</h1><p>Paste a token of this service (its operator makes one with "
        "<code>autotune token create NAME</code>). It is kept in a cookie this service alone reads.</p>"
        '<form method="post" action="/login" class="login">'
        f'<input type="hidden" name="next" value="{escape(target)}">'
        '<label>Token <input type="password" name="token" autocomplete="off" required></label>'
        '<button type="submit">Log in</button></form>'
    )


# -- the frame and small words ------------------------------------------------------------------------------


def _page(
    title: str,
    body: str,
    who: str | None,
    *,
    status: int = 200,
    live: dict[str, str] | None = None,
    refresh: int | None = None,
) -> HTMLResponse:
    if who:
        account = (
            f'<form method="post" action="/logout" class="logout"><span>{escape(who)}</span> '
            '<button type="submit">Log out</button></form>'
        )
    else:
        account = '<a href="/login">Log in</a>'
    attributes = "".join(f' {key}="{escape(value)}"' for key, value in (live or {}).items())
    script = '<script src="/static/live.js" defer></script>' if live is not None else ""
    meta = f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else ""
    text = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'{meta}<title>{escape(title)} · autotune</title><link rel="stylesheet" href="/static/style.css">'
        '<link rel="icon" href="/static/favicon.svg">'
        f'{script}</head><body{attributes}><header><nav><a class="brand" href="/">autotune</a>'
        f'<a href="/">Searches</a><a href="/plan">Plan</a><span class="account">{account}</span></nav></header>'
        f"<main>{body}</main></body></html>"
    )
    return HTMLResponse(text, status_code=status, headers=HEADERS)


def _error_line(line: str, login: str | None = None) -> str:
    first = (line.strip().splitlines() or ["failed"])[0]
    link = f' <a href="/login?next={quote(login, safe="")}">Log in</a>' if login else ""
    return f'<p class="error" role="alert">{escape(first)}{link}</p>'


def _progress(progress: dict[str, Any]) -> str:
    settled, total = progress.get("settled") or 0, progress.get("total")
    return f"{settled} / {total}" if total else f"{settled} settled"


def _where(view: dict[str, Any]) -> str:
    parts = [str(view[key]) for key in ("card", "device_name") if view.get(key)]
    if not parts and view.get("device"):
        parts.append(f"any {view['device']} worker")
    return " · ".join(dict.fromkeys(parts)) or "-"


def _state(view: dict[str, Any], with_reason: bool = True) -> str:
    state = str(view["state"])
    reason = view.get("reason") or ""
    tip = f' title="{escape(reason)}"' if reason and with_reason else ""
    ident = "" if with_reason else ' id="state"'
    return f'<span{ident} class="state state-{escape(state)}"{tip}>{escape(state)}</span>'
