"""Change a YAML file's top-level keys and keep everything else as written: comments, order, quoting,
blank lines. Without a round-trip YAML library: each top-level key's lines are found (the key's line,
then its indented or list lines), and only those of the keys changed are rewritten; the result is
parsed again and checked against what was asked (`edit` raises ValueError rather than return a file
that says anything else).
"""

from __future__ import annotations

import json
import re

from autotune.vocabulary import yaml_text

__all__ = ["edit", "render_value"]

# A top-level key, plain or quoted ("micro_batch_size": 2 is the same key: written in place, not again).
_KEY = re.compile(r"""^(?P<quote>["']?)(?P<key>[A-Za-z_][\w.-]*)(?P=quote)(?P<colon>\s*:)(?P<rest>.*)$""")
_TRAILING_COMMENT = re.compile(r"\s+#.*$")


def edit(
    text: str,
    updates: dict,
    remove: tuple[str, ...] = (),
    *,
    renamed: dict[str, str] | None = None,
    appended_note: str = "",
) -> str:
    """`text` with each key of `updates` set (in its place when present, else appended after
    `appended_note`), each of `remove` deleted, and nothing else changed. `renamed` (old key -> new):
    a new key absent from the file takes the old one's place, and its comment."""
    import yaml

    lines = text.splitlines(keepends=True)
    spans = _spans(lines)
    for old, new in (renamed or {}).items():
        if old in spans and new not in spans and new in updates:
            spans[new] = spans.pop(old)
            remove = (*remove, old)
    replaced: dict[int, list[str]] = {}
    for key, value in updates.items():
        if key in spans:
            start, end = spans[key]
            replaced[start] = _lines_for(key, value, lines[start])
            for index in range(start + 1, end):
                replaced[index] = []
    for key in remove:
        if key in spans and key not in updates:
            start, end = spans[key]
            for index in range(start, end):
                replaced[index] = []
    out = [piece for index, line in enumerate(lines) for piece in replaced.get(index, [line])]
    missing = [key for key in updates if key not in spans]
    if missing:
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        out += ["\n"] + ([f"# {appended_note}\n"] if appended_note else [])
        out += [line for key in missing for line in _lines_for(key, updates[key], "")]
    result = "".join(out)
    try:
        after = yaml.safe_load(result) or {}
    except yaml.YAMLError:
        raise ValueError(
            "the edited YAML does not read back (a key's lines are laid out in a way this edit cannot follow)"
        ) from None
    _check(yaml.safe_load(text) or {}, after, updates, remove)
    return result


def _spans(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Each top-level key's lines: [its line, the next line at column 0 that is not a list item)."""
    spans: dict[str, tuple[int, int]] = {}
    current: tuple[str, int] | None = None
    for index, line in enumerate(lines):
        continuing = line[:1] in (" ", "\t") or line.strip() == "" or line.startswith("- ")
        if continuing:
            continue
        if current is not None:
            spans[current[0]] = (current[1], _trim(lines, current[1], index))
            current = None
        if (match := _KEY.match(line.rstrip("\r\n"))) is not None:
            current = (match["key"], index)
    if current is not None:
        spans[current[0]] = (current[1], _trim(lines, current[1], len(lines)))
    return spans


def _trim(lines: list[str], start: int, end: int) -> int:
    """A key's block ends before the blank lines that follow it (they separate it from the next)."""
    while end - 1 > start and lines[end - 1].strip() == "":
        end -= 1
    return end


def _lines_for(key: str, value, old_line: str) -> list[str]:
    """The key set to `value`; a scalar keeps the comment the old line had after its value."""
    newline = "\r\n" if old_line.endswith("\r\n") else "\n"
    if isinstance(value, dict) and value:
        return [f"{key}:{newline}"] + [f"{line}{newline}" for line in yaml_text.block_lines(value, 1, render_value)]
    comment = ""
    if (match := _KEY.match(old_line.rstrip("\r\n"))) is not None and "#" in match["rest"]:
        found = _TRAILING_COMMENT.search(match["rest"])
        value_text = match["rest"][: found.start()] if found else match["rest"]
        if found and value_text.count('"') % 2 == 0 and value_text.count("'") % 2 == 0:
            comment = found.group(0)
    return [f"{key}: {render_value(value)}{comment}{newline}"]


def render_value(value) -> str:
    """yaml_text's scalar, but a plain word (sdpa, adamw_torch) bare, as people write it."""
    if isinstance(value, str) and _BARE.fullmatch(value) and _reads_back(value):
        return value
    return yaml_text.scalar(value)


_BARE = re.compile(r"[A-Za-z_][\w./-]*")


def _reads_back(text: str) -> bool:
    """Whether `text` unquoted is still that string to YAML (not true, null, a number...)."""
    import yaml

    return yaml.safe_load(text) == text


def _check(before: dict, after: dict, updates: dict, remove: tuple[str, ...]) -> None:
    expected = {key: value for key, value in before.items() if key not in remove}
    expected.update(updates)
    if _plain(after) != _plain(expected):
        wrong = sorted(key for key in set(after) | set(expected) if _plain(after.get(key)) != _plain(expected.get(key)))
        raise ValueError(f"the edited YAML does not read back as asked (keys {', '.join(wrong)})")


def _plain(value):
    return json.loads(json.dumps(value, default=str))
