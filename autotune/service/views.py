"""What the service says about a search, in one place for the API and the page: its state with the
reason, its progress, the leaderboard, the pick and why (as the command line's `--json` and
`explain_winner` say them), and each probe settled as an event (the line the command line prints).
And what the pages show beyond the API's documents (each row's need of the budget, the hand-off
snippets, a plan's verdicts), as plain values: the templates (service/templates) only lay them out,
so a rule such as what a configuration needs is said once, here or below, never in a template or in
live.js. Torch-free: the store's records and the report's words."""

from __future__ import annotations

import json

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from autotune.results.budget import Budget, required_bytes
from autotune.vocabulary.errors import StudyNotFound
from autotune.render.tables import explain_winner, format_event
from autotune.search.common import Event
from autotune.vocabulary.status import SEARCH_ENDED, ClaimState, ProbeStatus, SearchState, Settled, StudyStatus
from autotune.store import LeaderboardRow, ProbeRecord, SearchRecord, Store, StudyRecord
from autotune.store.claims import ROUND_KEY
from autotune.store.queue import QUEUE_STALE_SECONDS
from autotune.store.workers import WorkerRecord, why_waiting

# The hand-off snippets the search page shows: each the text /v1/searches/NAME/best?format=FMT answers with.
HANDOFF_FORMATS = ("trainer-args", "cli", "accelerate")

# A study searched from the command line (no submission) read as a search's state.
STUDY_STATES = {
    StudyStatus.RUNNING: SearchState.RUNNING,
    StudyStatus.FINISHED: SearchState.FINISHED,
    StudyStatus.INCOMPLETE: SearchState.FAILED,
    StudyStatus.INTERRUPTED: SearchState.INTERRUPTED,
}
STUDY_REASONS = {
    StudyStatus.INCOMPLETE: "some candidates could not be measured; run the same search again to retry them",
    StudyStatus.INTERRUPTED: "stopped before the end; run the same search again to resume",
}


@dataclass(slots=True)
class StoredOutcome:
    """What `report.explain_winner` reads of a search's outcome, from the store."""

    study: StudyRecord
    leaderboard: list[LeaderboardRow]
    unmeasured: list = field(default_factory=list)

    @property
    def best(self) -> LeaderboardRow | None:
        return self.leaderboard[0] if self.leaderboard else None


def links(name: str) -> dict[str, str]:
    base = f"/v1/searches/{quote(name, safe='')}"
    return {
        "self": base,
        "events": f"{base}/events",
        "best": f"{base}/best",
        "cancel": f"{base}/cancel",
        "page": f"/searches/{quote(name, safe='')}",
    }


def submitted_or_none(store: Store, name: str) -> SearchRecord | None:
    try:
        return store.queue.get(name)
    except StudyNotFound:
        return None


def study_or_none(store: Store, name: str) -> StudyRecord | None:
    try:
        return store.study(name)
    except StudyNotFound:
        return None


def search_view(store: Store, name: str, *, detail: bool = True) -> dict[str, Any]:
    """GET /v1/searches/{name}: a submitted search, or a study the command line searched; what it
    waits for (queued) or which worker holds it (running), and whether its confirmation round is on."""
    from autotune.store import check_study_lookup

    check_study_lookup(name)
    submitted = submitted_or_none(store, name)
    study = study_or_none(store, name)
    if submitted is None and study is None:
        raise StudyNotFound(
            f"no search or study named {name!r}; submit one with POST /v1/searches, or list them with GET /v1/searches."
        )
    settled = store.queue.settled_counts([name]).get(name, 0)
    view = summary_view(
        submitted, study, settled, workers=store.workers.connected(), confirming=_confirming(store, study)
    )
    if detail:
        board = store.leaderboard(name) if study is not None else []
        view["leaderboard"] = [row.to_dict() for row in board]
        view["best"] = best_document(store, name) if board else None
        view["why"] = (
            explain_winner(StoredOutcome(study, board))
            if study is not None and (board or view["state"] in (SearchState.FINISHED,))
            else None
        )
        view["confirmation"] = study.confirmation if study is not None else None
    return view


def summary_view(
    submitted: SearchRecord | None,
    study: StudyRecord | None,
    settled: int,
    best_tokens_per_s: float | None = None,
    *,
    workers: Sequence[WorkerRecord] = (),
    confirming: bool = False,
) -> dict[str, Any]:
    """A search's header: what, where, its state and progress (the list and the page's rows). A
    queued search says why it waits (`waiting`: store/workers.why_waiting over the connected
    `workers`); a running one which worker holds it (`held_by`, with its device where connected)."""
    name = submitted.name if submitted is not None else study.name  # type: ignore[union-attr]
    if submitted is not None:
        view = submitted.to_dict()
        # A search whose study is gone from the database (deleted by hand) still reads as submitted.
    else:
        assert study is not None
        state = STUDY_STATES.get(StudyStatus(study.status), SearchState.RUNNING)
        view = {
            "name": name,
            "state": state,
            "reason": STUDY_REASONS.get(StudyStatus(study.status)),
            "model": study.model_reference,
            "budget_bytes": study.budget_bytes,
            "device": None,
            "gpus": None,
            "card": None,
            "candidates": None,
            "arguments": None,
            "submitted_by": None,
            "created_at": study.created_at.isoformat(),
            "updated_at": study.updated_at.isoformat(),
        }
    view["waiting"] = (
        why_waiting(submitted, workers) if submitted is not None and view["state"] == SearchState.QUEUED else None
    )
    holder = submitted.worker if submitted is not None and view["state"] == SearchState.RUNNING else None
    devices = {w.label: w.device.describe() for w in workers}
    view["held_by"] = f"{holder} ({devices[holder]})" if holder in devices else holder
    view["source"] = "service" if submitted is not None else "command line"
    view["device_name"] = study.device_name if study is not None else None
    # The confirmation round's windows: probes too, beyond the configurations settled (issue 56).
    confirmation = (study.confirmation or {}) if study is not None else {}
    view["progress"] = {
        "settled": settled,
        "total": submitted.candidates if submitted is not None else None,
        "confirming": int(confirmation.get("probes") or 0),
        # The round is under way: every candidate settled, the contenders measured again.
        "phase": "confirming"
        if view["state"] == SearchState.RUNNING and (confirming or confirmation.get("partial"))
        else None,
    }
    view["best_tokens_per_s"] = best_tokens_per_s
    view["links"] = links(name)
    return view


def list_view(store: Store, limit: int) -> list[dict[str, Any]]:
    """GET /v1/searches: submitted searches and the command line's studies, newest first."""
    submitted = {s.name: s for s in store.queue.all(limit=limit)}
    workers = store.workers.connected()
    studies = {s.name: s for s in store.studies()}
    names = list(submitted) + [n for n in studies if n not in submitted]
    counts = store.queue.settled_counts(names[:limit])
    views = []
    for name in names[:limit]:
        summary = studies.get(name)
        study = None
        if summary is not None and name not in submitted:
            study = store.study(name)
        view = summary_view(
            submitted.get(name),
            study,
            counts.get(name, 0),
            summary.best_tokens_per_s if summary is not None else None,
            workers=workers,
        )
        if summary is not None:
            view["device_name"] = summary.device_name
        views.append(view)
    return views


def _confirming(store: Store, study: StudyRecord | None) -> bool:
    """Whether a live worker holds the study's confirmation round (its claim, store/claims.ROUND_KEY)."""
    if study is None or study.status != StudyStatus.RUNNING:
        return False
    claims = store.claims.of_study(study.id, stale_after=QUEUE_STALE_SECONDS)
    return any(c.config_key == ROUND_KEY and c.state == ClaimState.RUNNING and not c.stale for c in claims)


def may_cancel(view: dict[str, Any], who: str | None) -> bool:
    """Whether the token `who` may cancel the search `view` says: a submitted search not ended, by
    the token that submitted it (any token for one submitted before tokens were recorded)."""
    return (
        who is not None
        and view.get("source") == "service"
        and view["state"] not in SEARCH_ENDED
        and view.get("submitted_by") in (None, who)
    )


def cancel_search(store: Store, name: str, who: str) -> dict[str, Any]:
    """Stop a submitted search, for the API and the page's button alike: only the token that
    submitted it may (403); a study searched from the command line is stopped where it runs (409)."""
    from autotune.service.commands import RequestRefused

    submitted = submitted_or_none(store, name)
    if submitted is None:
        if study_or_none(store, name) is not None:
            raise RequestRefused(
                f"study {name!r} was searched from the command line, not submitted here; stop it where "
                f"it runs (Ctrl-C or SIGTERM).",
                status=409,
            )
        raise StudyNotFound(f"no search named {name!r}; list them with GET /v1/searches.")
    if submitted.submitted_by is not None and submitted.submitted_by != who:
        raise RequestRefused(
            f"search {name!r} was submitted with the token {submitted.submitted_by!r}; only that token may cancel it.",
            status=403,
        )
    store.queue.cancel(name, by=who)
    return search_view(store, name, detail=False)


def best_document(store: Store, name: str) -> dict[str, Any]:
    """`autotune best --format json` of the study, as an object."""
    from autotune.handoff.best_config import best_in

    return best_in(store, name).to_dict()


# -- events ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class EventReader:
    """A study's settled probes as events, in the order they were stored (each probe's row id is
    its event id, so a follower resumes after `Last-Event-ID`), numbered as the command line
    numbers them ([settled/total])."""

    name: str
    total: int | None
    last_id: int = 0
    seen: set[str] = field(default_factory=set)
    best: float = 0.0

    def skip_to(self, store: Store, last_id: int) -> None:
        """Start after event `last_id`: what came before it counted, not sent."""
        try:
            probes = store.probes(self.name)
        except StudyNotFound:
            probes = []
        for probe in probes:
            if probe.id > last_id:
                break
            self._count(probe)
        self.last_id = max(self.last_id, last_id)

    def read(self, store: Store) -> list[tuple[int, dict[str, Any]]]:
        """The events stored since the last read."""
        events = []
        try:
            probes = store.probes(self.name, after_id=self.last_id)
        except StudyNotFound:  # queued: its study is made when a worker starts it
            return []
        for probe in probes:
            best = self._count(probe)
            events.append((probe.id, event_view(probe, len(self.seen), self.total or len(self.seen), best)))
            self.last_id = probe.id
        return events

    def _count(self, probe: ProbeRecord) -> bool:
        self.seen.add(probe.config_key)
        speed = probe.result.tokens_per_s or 0.0
        if probe.result.status == ProbeStatus.OK and speed > self.best:
            self.best = speed
            return True
        return False


def event_view(probe: ProbeRecord, settled: int, total: int, best: bool) -> dict[str, Any]:
    r = probe.result
    how = Settled.SKIPPED if r.status == ProbeStatus.SKIPPED else Settled.PROBED
    line = format_event(Event(probe.config, r, how, settled, max(total, settled), best, probe.worker), show_worker=True)
    return {
        "id": probe.id,
        "settled": settled,
        "total": total,
        "config_key": probe.config_key,
        "label": probe.config.label(),
        "status": r.status,
        "tokens_per_s": r.tokens_per_s,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "context_bytes": r.context_bytes,
        "need_bytes": r.required_bytes,  # autotune.results.budget's rule: the need a page shows, never worked out in live.js
        "worker": probe.worker,
        "best": best,
        "error": r.error,
        "line": line,
        "finished_at": probe.finished_at.isoformat(),
    }


# -- what the pages show ----------------------------------------------------------------------------


def search_page_view(store: Store, name: str) -> dict[str, Any]:
    """Everything a search's page shows: the search as GET /v1/searches/{name} says it, the margin
    kept free, the leaderboard with each row's need, every probe settled as its event says it (the
    event carries the need, as the live stream's does) and the hand-off snippets once there is a pick."""
    view = search_view(store, name)
    study = study_or_none(store, name)
    events = EventReader(name, view["progress"]["total"]).read(store) if study is not None else []
    return {
        "search": view,
        "margin_bytes": study.margin_bytes if study is not None else None,
        "leaderboard": leaderboard_rows(view["leaderboard"]),
        "probes": [data for _, data in events],
        "why": view.get("why"),
        "snippets": handoff_snippets(store, view) if view.get("best") else [],
    }


def leaderboard_rows(board: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leaderboard's rows with what each needs (autotune.results.budget's rule: peak reserved + context),
    what its budget allows (less the margin) and the need's share of that, None where unknown."""
    rows = []
    for row in board:
        need = required_bytes(row["peak_reserved_bytes"], row["context_bytes"])
        allowed = (
            Budget(row["budget_bytes"], row["margin_bytes"]).allowed_bytes
            if row["budget_bytes"] and row["margin_bytes"] is not None
            else None
        )
        share = need / allowed if need is not None and allowed else None
        rows.append({**row, "need_bytes": need, "allowed_bytes": allowed, "share": share})
    return rows


def handoff_snippets(store: Store, view: dict[str, Any]) -> list[dict[str, str]]:
    """The pick handed off in each of HANDOFF_FORMATS: its text, the link to it raw, and the id the
    page's copy button names."""
    from autotune.handoff.best_config import best_in

    chosen = best_in(store, view["name"])
    return [
        {
            "format": fmt,
            "ident": f"handoff-{fmt}",
            "raw": f"{view['links']['best']}?format={quote(fmt)}",
            "text": chosen.render(fmt),
        }
        for fmt in HANDOFF_FORMATS
    ]


def plan_view(document: dict[str, Any]) -> dict[str, Any]:
    """/v1/plan's answer as the plan page shows it: every field there (a missing one reads "None" or
    "-", as it always has), each candidate's verdict, and what the budget allows less its margin."""
    candidates = []
    for candidate in document.get("candidates") or []:
        fits = candidate.get("fits")
        candidates.append(
            {
                "label": str(candidate.get("label")),
                "fits": bool(fits),
                "verdict": "fits" if fits else "over" if fits is False else "-",
                "need_bytes": candidate.get("need_bytes"),
                "tokens_per_s": candidate.get("tokens_per_s"),
                "why_not": str(candidate.get("why_not") or ""),
            }
        )
    allowed = (document.get("budget_bytes") or 0) - (document.get("margin_bytes") or 0)
    return {
        "model": str(document.get("model")),
        "target": str(document.get("target")),
        "candidates": candidates,
        "fitting": sum(1 for c in candidates if c["fits"]),
        "allowed_bytes": allowed or None,
        "notes": [str(note) for note in document.get("notes") or []],
    }


def plan_page_view(document: dict[str, Any]) -> dict[str, Any]:
    """A plan's document as the plan page shows it: one card's table (plan_view), or which card to
    rent (rental_view) where it weighs several cards or counts (`autotune plan --tokens`)."""
    if "options" in document:
        return {"kind": "rentals", **rental_view(document)}
    return {"kind": "card", **plan_view(document)}


def rental_view(document: dict[str, Any]) -> dict[str, Any]:
    """A RentalPlan's document (planner/rental_plan.py `to_dict`) as the page shows it: a row per
    card and count in the document's order, each marked as the document names it (cheapest, fastest,
    on the front: RentalPlan.marks, read from each option, not worked out again), its speed with the
    stated error."""
    from autotune.planner.speed_error import SpeedError
    from autotune.vocabulary.units import format_duration, format_tokens

    error = document.get("speed_error")
    stated = SpeedError(int(error["count"]), float(error["median"]), float(error["worst"])) if error else None

    def key(value: Any) -> tuple[str, int] | None:
        return (str(value[0]), int(value[1])) if isinstance(value, list | tuple) and len(value) == 2 else None

    cheapest, fastest = key(document.get("cheapest")), key(document.get("fastest"))
    front = [key(value) for value in document.get("front") or []]
    rows = []
    for option in document.get("options") or []:
        card, gpus = str(option.get("card")), int(option.get("gpus") or 0)
        seconds, cost = option.get("seconds"), option.get("cost")
        on_front = (card, gpus) in front
        rows.append(
            {
                "card": card,
                "card_name": str(option.get("card_name") or card),
                "gpus": gpus,
                "label": f"{card} ×{gpus}",
                "runs": seconds is not None,
                "config": str(option.get("config") or "-"),
                "need_bytes": option.get("need_bytes"),
                "tokens_per_s": option.get("tokens_per_s"),
                "seconds": seconds,
                "time": format_duration(seconds) if seconds is not None else "-",
                "per_gpu_hour": option.get("per_gpu_hour"),
                "cost": cost,
                "cost_text": f"${cost:,.2f}" if cost is not None else "no price" if seconds is not None else "-",
                "price_source": str(option.get("price_source") or ""),
                "why_none": str(option.get("why_none") or ""),
                "on_front": on_front,
                "marks": [str(mark) for mark in option.get("marks") or []],
            }
        )
    by_key = {(row["card"], row["gpus"]): row for row in rows}
    return {
        "model": str(document.get("model")),
        "tokens": format_tokens(int(document.get("tokens") or 0)),
        "sort": str(document.get("sort") or "cost"),
        "band": f"±{stated.median:.0%}" if stated is not None else None,
        "error_text": stated.text() if stated is not None else None,
        "rows": rows,
        "cheapest": by_key[cheapest]["label"] if cheapest in by_key else None,
        "fastest": by_key[fastest]["label"] if fastest in by_key else None,
        "front": [by_key[k]["label"] for k in front if k in by_key],
        "unpriced": [row["label"] for row in rows if row["runs"] and row["cost"] is None],
        "prices": str(document["prices"]) if document.get("prices") else None,
        "notes": [str(note) for note in document.get("notes") or []],
        "seconds": format_duration(float(document.get("seconds") or 0.0)),
        "traces": int(document.get("traces") or 0),
    }


def where_text(view: dict[str, Any]) -> str:
    """Where a search runs, in words: its card and device, else the kind of worker it waits for."""
    parts = [str(view[key]) for key in ("card", "device_name") if view.get(key)]
    if not parts and view.get("device"):
        parts.append(f"any {view['device']} worker")
    return " · ".join(dict.fromkeys(parts)) or "-"


def progress_text(progress: dict[str, Any]) -> str:
    """'3 / 8', or '3 settled' where the count of candidates is not known; during the confirmation
    round, that it is on and its windows so far (the event stream's `state` carries this text to live.js)."""
    settled, total = progress.get("settled") or 0, progress.get("total")
    text = f"{settled} / {total}" if total else f"{settled} settled"
    if progress.get("phase") == "confirming":
        windows = progress.get("confirming") or 0
        text += f" · confirmation round: the contenders measured again ({windows} window{'s' if windows != 1 else ''} so far)"
    return text


# `autotune best`'s formats that are JSON documents; the others are text (YAML, flags, scripts).
JSON_FORMATS = ("json", "trainer-args", "trl")


def best_response(chosen, format: str, document: dict | None = None):
    """A study's pick as `autotune best --format FORMAT` prints it, for /best and /v1/answers alike:
    a JSON format as application/json, the others as text; the notes `best` prints on stderr in
    `Autotune-Note` (Latin-1, as headers are: a character beyond it as '?'). `document`: /answers'
    JSON envelope, which carries the notes too."""
    from fastapi.responses import PlainTextResponse, Response

    notes = chosen.notes(format)
    headers = {"Autotune-Note": " | ".join(n.encode("latin-1", "replace").decode("latin-1")[:500] for n in notes)}
    if not notes:
        headers = {}
    if document is not None:
        return Response(
            json.dumps({**document, "notes": notes}, indent=2), media_type="application/json", headers=headers
        )
    text = chosen.render(format) + "\n"
    if format in JSON_FORMATS:
        return Response(text, media_type="application/json", headers=headers)
    return PlainTextResponse(text, headers=headers)
