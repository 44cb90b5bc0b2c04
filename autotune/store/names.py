"""Study names: what a new study may be called. A name becomes part of paths (`autotune train`'s
./autotune-runs/STUDY) and of Optuna's study name, and is typed on command lines, so it is kept to
characters that are safe in all three."""

from __future__ import annotations

import re

from autotune.errors import BadInput

STUDY_NAME_MAX = 200
_ALLOWED = re.compile(r"[A-Za-z0-9._:@+-]+")


def check_study_name(name: str | None, *, flag: str = "--study") -> str:
    """`name` if a new study may have it; BadInput naming `flag` otherwise. Letters, digits and
    `. _ - : @ +`, at most STUDY_NAME_MAX characters, not `.` or `..` (they name directories) and
    not starting with `-` (it would read as a flag)."""
    text = name if isinstance(name, str) else ""
    rule = (f"use letters, digits and . _ - : @ + (no spaces or slashes), at most {STUDY_NAME_MAX} characters, "
            f"not starting with '-'")
    if not text.strip():
        raise BadInput(f"{flag} is empty; give the study a name ({rule}), or leave {flag} out for the default.")
    if len(text) > STUDY_NAME_MAX:
        raise BadInput(f"{flag} is {len(text)} characters long; {rule}.")
    if not _ALLOWED.fullmatch(text):
        bad = "".join(dict.fromkeys(c for c in text if not _ALLOWED.fullmatch(c)))
        raise BadInput(f"{flag} {text!r} has characters a study name cannot have ({bad!r}); {rule}.")
    if text in (".", ".."):
        raise BadInput(f"{flag} {text!r} names a directory, not a study; {rule}.")
    if text.startswith("-"):
        raise BadInput(f"{flag} {text!r} starts with '-'; {rule}.")
    return text
