"""/v1/answers: the stored answer for a model, a budget and a card, for a pipeline that asks before
it trains; 404 saying how to submit one where none is stored. /healthz: whether the service and its
database answer."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from autotune.vocabulary.errors import StudyNotFound
from autotune.service.auth import require_reader
from autotune.service.commands import RequestRefused
from autotune.service.views import best_response, links
from autotune.vocabulary.status import StudyStatus

router = APIRouter(tags=["answers"])


@router.get("/v1/answers")
def answer(
    request: Request,
    model: str = Query(max_length=1000),
    budget: str = Query(max_length=40),
    gpu: str | None = Query(default=None, max_length=100),
    format: str = Query(default="json"),
    _: str | None = Depends(require_reader),
) -> Response:
    """The pick of the latest finished search of `model` under `budget` (on a card whose name
    carries `gpu`), in any format `autotune best` prints."""
    from autotune.flags.table import BEST_FORMATS
    from autotune.vocabulary.errors import AutotuneError
    from autotune.handoff.best_config import best_in
    from autotune.vocabulary.units import format_size, parse_budget

    if format not in BEST_FORMATS:
        raise RequestRefused(f"format {format[:40]!r}: give one of {', '.join(BEST_FORMATS)}.")
    try:
        budget_bytes = parse_budget(budget)
    except AutotuneError as exc:
        raise RequestRefused(f"budget: {exc}") from None
    store = request.app.state.store
    for study in store.studies():  # (newest first)
        if (
            study.status != StudyStatus.FINISHED
            or study.best_tokens_per_s is None
            or study.budget_bytes != budget_bytes
        ):
            continue
        if not _same_model(study.model_reference, model) or (gpu and gpu.lower() not in study.device_name.lower()):
            continue
        chosen = best_in(store, study.name)
        if format != "json":
            return best_response(chosen, format)
        document: dict[str, Any] = {
            "study": study.name,
            "device": study.device_name,
            "best": chosen.to_dict(),
            "links": links(study.name),
        }
        return best_response(chosen, format, document)
    on = f" on {gpu}" if gpu else ""
    example = {"model": model, "gpu_budget": budget, **({"gpu": gpu} if gpu else {})}
    raise StudyNotFound(
        f"no finished search of {model} under {format_size(budget_bytes)}{on} is stored; submit one: "
        f"POST /v1/searches {json.dumps(example)}"
    )


def _same_model(reference: str, model: str) -> bool:
    """A study's model is the one asked for: the same reference, or a local directory of that name."""
    return reference == model or reference.rstrip("/").rsplit("/", 1)[-1] == model.rstrip("/")


@router.get("/healthz")
def health(request: Request) -> dict[str, Any]:
    """200 when the service and its database answer (503 otherwise): the database's kind, never its
    path or host (anyone may ask)."""
    request.app.state.store.tokens.any()  # (a database that cannot answer is a 503, by the app's handler)
    return {"status": "ok", "database": request.app.state.store.engine.url.get_backend_name()}
