"""Study names: what a new study may be called, and what may be looked up. A name becomes part of
paths (`autotune train`'s ./autotune-runs/STUDY) and of Optuna's study name, and is typed on command
lines, so a new one is kept to characters that are safe in all three. A name given to find a study
is checked more loosely (studies named before the rule existed must still be found), but it must be
text the database can store: valid UTF-8, printable, and no longer than the column holds."""

from __future__ import annotations

import re

from typing import TYPE_CHECKING

from autotune.vocabulary.errors import BadInput

if TYPE_CHECKING:
    from autotune.store.schema import Study

STUDY_NAME_MAX = 200  # also the length of autotune_studies.name
_ALLOWED = re.compile(r"[A-Za-z0-9._:@+-]+")
_SHOWN_MAX = 60


def shown(text: str) -> str:
    """`text` quoted for a message whatever it holds: bytes that are not UTF-8 (which Python hands
    over as surrogate escapes) as \\xNN, characters that cannot be printed escaped, a long one cut."""
    readable = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    readable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in readable)
    if len(readable) > _SHOWN_MAX:
        readable = readable[:_SHOWN_MAX] + "..."
    return f"'{readable}'"


def check_study_name(name: str | None, *, flag: str = "--study") -> str:
    """`name` if a new study may have it; BadInput naming `flag` otherwise. Letters, digits and
    `. _ - : @ +`, at most STUDY_NAME_MAX characters, not `.` or `..` (they name directories) and
    not starting with `-` (it would read as a flag)."""
    text = name if isinstance(name, str) else ""
    rule = (
        f"use letters, digits and . _ - : @ + (no spaces or slashes), at most {STUDY_NAME_MAX} characters, "
        f"not starting with '-'"
    )
    if not text.strip():
        raise BadInput(f"{flag} is empty; give the study a name ({rule}), or leave {flag} out for the default.")
    if len(text) > STUDY_NAME_MAX:
        raise BadInput(f"{flag} is {len(text)} characters long; {rule}.")
    if not _ALLOWED.fullmatch(text):
        bad = "".join(dict.fromkeys(c for c in text if not _ALLOWED.fullmatch(c)))
        raise BadInput(f"{flag} {shown(text)} has characters a study name cannot have ({shown(bad)}); {rule}.")
    if text in (".", ".."):
        raise BadInput(f"{flag} {text!r} names a directory, not a study; {rule}.")
    if text.startswith("-"):
        raise BadInput(f"{flag} {text!r} starts with '-'; {rule}.")
    return text


def check_study_lookup(name: str | None, *, flag: str = "--study") -> str | None:
    """`name` if it can name a study to look up (None passes: "the most recent one"); BadInput
    naming `flag` otherwise: empty, not valid UTF-8 (`--study $'\\xff'` arrives as surrogate
    escapes, which no database can be asked about), holding a character that cannot be printed,
    or longer than any stored name can be."""
    if name is None:
        return None
    what = "give the study's name as `autotune studies` lists it"
    if not name.strip():
        # No study is ever named so (check_study_name); an empty --study is a mistake, not "the latest".
        raise BadInput(
            f"{flag} is empty; give a study name (list them with `autotune studies`), or leave "
            f"{flag} out for the most recent one."
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(
            f"{flag} {shown(name)} is not valid UTF-8 text (bytes the terminal or script passed "
            f"that no study name has); {what}."
        ) from None
    if len(name) > STUDY_NAME_MAX:
        raise BadInput(
            f"{flag} is {len(name)} characters long, and no study name is longer than {STUDY_NAME_MAX}; {what}."
        )
    if not name.isprintable():
        bad = "".join(dict.fromkeys(c for c in name if not c.isprintable()))
        raise BadInput(f"{flag} {shown(name)} holds characters that cannot be printed ({shown(bad)}); {what}.")
    return name


def check_same_study(
    study: Study, fingerprint: str, reference: str, budget_bytes: int, margin_bytes: int | None, effective_batch: int
) -> None:
    """A study's name taken again: only for the same model (by fingerprint), budget, margin and
    effective batch (BadInput otherwise): what `search --study` resumes, and what a submission to
    the service may take over (store/queue.py, which knows no margin before a worker's device says
    it: None)."""
    from autotune.vocabulary.units import format_size

    differences = []
    if study.model_fingerprint != fingerprint:
        differences.append(f"model {study.model_reference!r} (not {reference!r})")
    if study.budget_bytes != budget_bytes:
        differences.append(f"budget {format_size(study.budget_bytes)} (not {format_size(budget_bytes)})")
    if margin_bytes is not None and study.margin_bytes != margin_bytes:
        differences.append(f"margin {format_size(study.margin_bytes)} (not {format_size(margin_bytes)})")
    if study.effective_batch != effective_batch:
        differences.append(f"effective batch {study.effective_batch} (not {effective_batch})")
    if differences:
        raise BadInput(
            f"study {study.name!r} already exists with {', '.join(differences)}; pick another --study name, "
            f"or resume it with the same settings."
        )
