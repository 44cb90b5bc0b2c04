"""The one bounded reader of a user's config file (`search --from`, `best --update`): every hostile
file is one line, fast, and nothing is read past the bounds: a FIFO (it would block), a device (it
would never end), a file past the size cap, YAML's alias bomb, nesting past the depth cap, a key
given twice. Real FIFOs and files made in the test; each case would hang, take exponential time, end
in a traceback, or silently read another value without the reader (host/config_files.py)."""

from __future__ import annotations

import os
import re
import time

import pytest

from autotune.host.config_files import MAX_BYTES, MAX_DEPTH, parse_config, read_config_text
from autotune.recipe_files import read_recipe_file
from autotune.vocabulary.errors import BadInput
from tests.helpers.cli import assert_usage_error, invoke

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)  # 10^9 values once expanded, in 9 lines


def make(tmp_path, kind: str):
    path = tmp_path / ("recipe.json" if kind.endswith("json") else "recipe.yml")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        return "/dev/zero"
    elif kind == "big":
        path.write_text("base_model: gpt2\n" + "# padding\n" * (MAX_BYTES // 10 + 1))
    elif kind == "bomb":
        path.write_text("base_model: gpt2\n" + BOMB)
    elif kind == "deep yaml":
        path.write_text("base_model: gpt2\nx: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n")
    elif kind == "deep json":
        path.write_text('{"model_name_or_path": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "twice yaml":
        path.write_text("base_model: gpt2\nmicro_batch_size: 2\nmicro_batch_size: 8\n")
    elif kind == "twice json":
        path.write_text(
            '{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "per_device_train_batch_size": 8}'
        )
    elif kind == "not utf-8":
        path.write_bytes(b"base_model: gpt2\nnote: \xff\xfe\n")
    return str(path)


CASES = [
    ("fifo", "not a regular file"),
    ("device", "not a regular file"),
    ("big", "larger than 1024 KiB"),
    ("bomb", "more than 100,000 values once its aliases are expanded"),
    ("deep yaml", f"nested deeper than any config ({MAX_DEPTH} levels at most)"),
    ("deep json", f"nested deeper than any config ({MAX_DEPTH} levels at most)"),
    ("twice yaml", "the key 'micro_batch_size' is given twice"),
    ("twice json", "the key 'per_device_train_batch_size' is given twice"),
    ("not utf-8", "not UTF-8 text"),
]


@pytest.mark.parametrize(("kind", "needle"), CASES, ids=[kind for kind, _ in CASES])
def test_a_hostile_config_file_is_one_line_fast(tmp_path, hermetic_home, kind, needle):
    path = make(tmp_path, kind)
    started = time.monotonic()
    with pytest.raises(BadInput, match=re.escape(needle)):
        read_recipe_file(path)
    assert time.monotonic() - started < 5.0
    before = sorted(hermetic_home.rglob("*"))
    assert_usage_error(invoke("search", "--from", path, "--gpu-budget", "1GiB"), needle)
    assert sorted(hermetic_home.rglob("*")) == before


def test_a_plain_config_reads_as_before_and_says_its_line_endings(tmp_path):
    path = tmp_path / "recipe.yml"
    path.write_bytes(b"base_model: gpt2\r\nmicro_batch_size: 2\r\nshared: &s {a: 1}\r\nagain: *s\r\n")
    text, crlf = read_config_text(path, "--from")
    assert crlf and "\r" not in text
    assert parse_config(path, text, "--from") == {
        "base_model": "gpt2",
        "micro_batch_size": 2,
        "shared": {"a": 1},
        "again": {"a": 1},
    }
