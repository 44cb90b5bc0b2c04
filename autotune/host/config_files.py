"""The one bounded reader of a user's config file (`search --from`, `best --update`): a regular file
(a FIFO would block, a device like /dev/zero would never end), at most MAX_BYTES, UTF-8, and parsed
as JSON or YAML within MAX_DEPTH levels of nesting and MAX_NODES values with YAML's aliases expanded
(an "alias bomb" of a few lines expands to billions), with no key given twice (YAML keeps the last,
JSON too: the file would not say what the user reads in it). Every refusal is one BadInput line
naming the file; nothing is read past the bounds."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from autotune.vocabulary.errors import BadInput

# A training config is a few kilobytes; the largest published axolotl examples are under 10 KiB.
MAX_BYTES = 1024 * 1024
MAX_DEPTH = 32
MAX_NODES = 100_000


def read_config_text(
    path: Path, flag: str, *, max_bytes: int = MAX_BYTES, what: str = "training config"
) -> tuple[str, bool]:
    """The file's text (newlines as \\n) and whether it ends its lines with \\r\\n (a price table,
    read by the same rules, may be longer: `max_bytes`, and is `what` the refusal names)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise BadInput(f"{flag} {path}: no such file.") from None
    except IsADirectoryError:
        raise BadInput(f"{flag} {path}: a directory, not a config file.") from None
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot be read ({exc.strerror or exc}).") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise BadInput(f"{flag} {path}: a directory, not a config file.")
        if not stat.S_ISREG(mode):
            raise BadInput(f"{flag} {path}: not a regular file (a FIFO, a device or a socket); give a config file.")
        handle = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise BadInput(f"{flag} {path}: larger than {max_bytes // 1024} KiB; no {what} is that long.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{flag} {path}: not UTF-8 text (byte {exc.start}).") from None
    crlf = "\r\n" in text
    return text.replace("\r\n", "\n").replace("\r", "\n"), crlf


def parse_config(path: Path, text: str, flag: str) -> Any:
    """`text` as JSON (a .json file) or YAML, within the bounds above."""
    if path.suffix.lower() == ".json":
        try:
            document = json.loads(text, object_pairs_hook=lambda pairs: _no_twice(path, flag, pairs))
        except json.JSONDecodeError as exc:
            raise BadInput(f"{flag} {path}: not valid JSON (line {exc.lineno}: {exc.msg}).") from None
        except RecursionError:
            raise BadInput(f"{flag} {path}: nested deeper than any config ({MAX_DEPTH} levels at most).") from None
        _check_shape(path, flag, document)
        return document
    return _yaml(path, text, flag)


def _no_twice(path: Path, flag: str, pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise BadInput(f"{flag} {path}: the key {key!r} is given twice; keep one.")
        seen[key] = value
    return seen


def _check_shape(path: Path, flag: str, document: Any) -> None:
    problem = json_shape_problem(document, max_depth=MAX_DEPTH, max_values=MAX_NODES)
    if problem == "depth":
        raise BadInput(f"{flag} {path}: nested deeper than any config ({MAX_DEPTH} levels at most).")
    if problem == "values":
        raise BadInput(f"{flag} {path}: more than {MAX_NODES:,} values; no training config has that many.")
    if problem == "text":
        raise BadInput(f"{flag} {path}: a string that is not text (a lone UTF-16 surrogate escape).")


def json_shape_problem(document: Any, *, max_depth: int, max_values: int) -> str | None:
    """What is wrong with a parsed JSON document's shape, if anything: "depth" (nested deeper than
    `max_depth`), "values" (more than `max_values`), "text" (a string, key or value, that is not
    Unicode text: JSON's "\\ud800" parses to one). Walked without recursion, so a deep one cannot
    recurse here; the config reader and the service's request bodies both hold to it."""
    stack, count = [(document, 1)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > max_depth:
            return "depth"
        if count > max_values:
            return "values"
        if isinstance(value, dict):
            stack += [(key, depth + 1) for key in value] + [(item, depth + 1) for item in value.values()]
        elif isinstance(value, list):
            stack += [(item, depth + 1) for item in value]
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "text"
    return None


def _yaml(path: Path, text: str, flag: str) -> Any:
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise BadInput(f"{flag} {path}: nested deeper than any config ({MAX_DEPTH} levels at most).") from None
        if node is None:
            return None
        _check_node(path, flag, node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise BadInput(f"{flag} {path}: not valid YAML ({where}{getattr(exc, 'problem', None) or exc}).") from None
    finally:
        loader.dispose()


def _check_node(path: Path, flag: str, root: Any) -> None:
    """The composed YAML graph (an alias is the anchored node itself, shared): its depth, its size
    with every alias expanded (each node's expanded size computed once), and no mapping key twice."""
    import yaml

    sizes: dict[int, int] = {}

    def children(node: Any) -> list:
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        return []

    # Post-order without recursion: each node's expanded size from its children's.
    stack: list[tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise BadInput(f"{flag} {path}: nested deeper than any config ({MAX_DEPTH} levels at most).")
        if id(node) in sizes:
            continue
        if not done:
            if isinstance(node, yaml.MappingNode):
                keys = [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode)]
                twice = sorted({key for key in keys if keys.count(key) > 1})
                if twice:
                    raise BadInput(f"{flag} {path}: the key {twice[0]!r} is given twice; keep one.")
            stack.append((node, depth, True))
            stack += [(child, depth + 1, False) for child in children(node) if id(child) not in sizes]
            continue
        sizes[id(node)] = total = 1 + sum(sizes.get(id(child), 1) for child in children(node))
        if total > MAX_NODES:
            raise BadInput(
                f"{flag} {path}: more than {MAX_NODES:,} values once its aliases are expanded; no training "
                f"config has that many."
            )
