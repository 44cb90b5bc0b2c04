"""YAML written without a YAML library (the read-only commands import none): scalars as YAML reads
them back, lists and empty mappings in JSON's flow style (which YAML reads), mappings as blocks."""

from __future__ import annotations

import json

__all__ = ["block_lines", "scalar"]


def scalar(value) -> str:
    """A value on one line: true/false/null, a number, a list or mapping in flow style, or a quoted
    string (quoted: YAML 1.1 reads a bare no/off as false, 1e3 as a number)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return json.dumps(str(value))


def block_lines(document: dict, depth: int = 0, render=scalar) -> list[str]:
    """`document` as block-style lines at `depth` (two spaces each): a non-empty mapping nests,
    anything else is `render`ed on its key's line."""
    pad = "  " * depth
    lines = []
    for key, value in document.items():
        if isinstance(value, dict) and value:
            lines += [f"{pad}{key}:"] + block_lines(value, depth + 1, render)
        else:
            lines.append(f"{pad}{key}: {render(value)}")
    return lines
