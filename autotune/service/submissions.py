"""What the service lets a client name, and a submitted search worked out as the command line works
it out: the body read as `autotune search`'s flags (commands.py), those flags read by the command's
own reader (search/request_flags.py) and the search resolved (search/request.py
resolve_search: the model, the space, its candidates, the study's name), all before anything is
written. A request the command line would refuse is refused with its line.

A service must not become a way to read the server's files or run code: a client names a model, a
data set or a tokenizer by hub id, or by a directory under the operator's `--model-root`; a model's
own code runs only where the operator passed `--allow-remote-code`."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.vocabulary.devices import worker_kind
from autotune.flags.flag import Part, refusal_line
from autotune.flags.table import READ_FIELDS, SEARCH
from autotune.service.commands import RequestRefused, read_request
from autotune.store.queue import Submission

# search's flags that say where and how its workers start, or where the answer goes, not what is
# searched (all closed to clients: flags/table.py).
NOT_SEARCHED = frozenset(row.python_name for row in SEARCH if row.part in (Part.LAUNCH, Part.OUTPUT))
# The service's own fields: the device kind the workers must have, and a card they must carry.
SEARCH_OWN = frozenset({"device", "gpu"})
DEVICE_KINDS = ("auto", "cuda", "cpu")
CARD = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}")
# A model's, data set's or tokenizer's name, at most (a hub id is far shorter).
MAX_REFERENCE_CHARS = 1000


@dataclass(frozen=True, slots=True)
class ServicePolicy:
    """What the operator allows clients to name (autotune serve's flags)."""

    model_root: Path | None = None  # local models, data sets and tokenizers: only under it
    allow_remote_code: bool = False  # --trust-remote-code in a request

    def named(self, body: object) -> object:
        """`body` with every field that names something to read (READ_FIELDS: a model, a data set, a
        tokenizer) as `reference` lets it be read: the one policy every route applies to what a client
        names (a search, a plan, an estimate, the plan page's form)."""
        if not isinstance(body, dict):
            return body
        return {k: self.reference(k, v) if k in READ_FIELDS else v for k, v in body.items()}

    def reference(self, field: str, value: Any) -> Any:
        """A client's model, data set or tokenizer as the service lets it be read: a name under
        the model root becomes that directory's absolute path; a hub id stays as it is; a path
        anywhere else is refused (403)."""
        if not isinstance(value, str) or not value.strip():
            return value  # (the command's own reading refuses it)
        text = value.strip()
        if "\x00" in text or len(text) > MAX_REFERENCE_CHARS:
            raise RequestRefused(
                f"{field}: give a hub id or a directory's name of at most {MAX_REFERENCE_CHARS} "
                f"characters, without NUL."
            )
        try:
            return self._reference(field, text)
        except (OSError, ValueError):  # (a name past the file system's limits: no file of it to read)
            raise RequestRefused(
                f"{field} {text[:80]!r} is no usable name: a path component past the file system's "
                f"limit; give a hub id or a directory under the service's --model-root."
            ) from None

    def _reference(self, field: str, text: str) -> str:
        root = self.model_root
        pathlike = (
            text.startswith(("/", ".", "~"))
            or "\\" in text
            or ".." in text.split("/")
            or re.match(r"[A-Za-z]+:", text) is not None
            and field != "dataset"
        )
        if root is not None and not pathlike:
            candidate = (root / text).resolve()
            if candidate.exists() and _inside(candidate, root):
                return str(candidate)
        if pathlike:
            if root is not None and os.path.isabs(text) and _inside(Path(text).resolve(), root):
                return str(Path(text).resolve())
            raise RequestRefused(
                f"{field} {text[:80]!r} names a path on the server; name a hub id, or a directory under "
                f"the service's --model-root{'' if root else ' (none is set)'}.",
                status=403,
            )
        if Path(text).exists():
            # A hub id that is also a path relative to the server's working directory would be read from there.
            raise RequestRefused(
                f"{field} {text[:80]!r} is also a path on the server, which the service does not read; "
                f"name a hub id with its owner, or a directory under the service's --model-root.",
                status=403,
            )
        return text


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root.resolve())
    except ValueError:
        return False
    return True


def submission_of(body: object, policy: ServicePolicy) -> Submission:
    """A POST /v1/searches body as the queue stores it, checked as `autotune search` checks its
    flags (RequestRefused with the command line's line otherwise). Writes nothing, starts nothing."""
    import click

    from autotune.search.request_flags import resolve_search_flags
    from autotune.vocabulary.errors import AutotuneError

    request, own = read_request("search", policy.named(body), own=SEARCH_OWN)
    device = _device_kind(own.get("device"))
    card = _card(own.get("gpu"))
    params = {k: v for k, v in request.params.items() if k not in NOT_SEARCHED}
    if params.get("trust_remote_code") and not policy.allow_remote_code:
        raise RequestRefused(
            "trust_remote_code: this service does not run a model's own code; its operator allows it "
            "with autotune serve --allow-remote-code.",
            status=403,
        )
    # Checked for the device the workers have, not this server's (which may have no GPU at all).
    params["device"] = device
    try:
        flags, resolved = resolve_search_flags(params)
    except (AutotuneError, click.ClickException) as exc:  # (click's: flags that only make sense together)
        raise RequestRefused(refusal_line(exc)) from None
    arguments = request.arguments
    digest = hashlib.sha256(
        json.dumps({"arguments": arguments, "device": device, "gpu": card}, sort_keys=True).encode()
    ).hexdigest()
    return Submission(
        name=resolved.name,
        arguments=arguments,
        request_hash=digest,
        model=flags.model,
        budget_bytes=flags.budget,
        device_kind=device,
        gpus=resolved.space.gpus,
        card=card,
        candidates=len(resolved.candidates),
        model_fingerprint=resolved.spec.fingerprint,
        effective_batch=resolved.space.work_per_step,
    )


def _device_kind(value: object) -> str:
    """The device a search's workers must have: cuda (auto and cuda) or cpu."""
    if value is None:
        return "cuda"
    if not isinstance(value, str) or value.strip().lower() not in DEVICE_KINDS:
        raise RequestRefused(f"device {str(value)[:40]!r}: give cuda (or auto) for GPU workers, or cpu.")
    return worker_kind(value)


def _card(value: object) -> str | None:
    """A card's name the worker's device must carry (e.g. A10G, H100): letters, digits, ' ._-'."""
    if value is None:
        return None
    if not isinstance(value, str) or not CARD.fullmatch(value.strip()):
        raise RequestRefused(
            f"gpu {str(value)[:40]!r}: give a card's name as its device name says it (e.g. A10G, "
            f"H100), up to 100 letters, digits, spaces, '.', '_' or '-'."
        )
    return value.strip()
