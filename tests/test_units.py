import pytest

from autotune.errors import BadInput
from autotune.units import format_size, parse_duration, parse_int_list, parse_margin, parse_size

GiB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * GiB), ("8 GiB", 8 * GiB), ("8192MiB", 8 * GiB), ("7.5GiB", int(7.5 * GiB)),
    ("8GB", 8 * 10**9), ("1024", 1024), ("8gib", 8 * GiB), ("8G", 8 * GiB), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8XB", "-1GiB", "0", "", "GiB", "eight GiB", "nan GiB", "1e400GiB"])
def test_parse_size_rejects_with_the_flag_named(text):
    with pytest.raises(BadInput, match="--gpu-budget"):
        parse_size(text)


def test_format_size():
    assert format_size(8 * GiB) == "8.00 GiB"
    assert format_size(1536 * 2**20) == "1.50 GiB"
    assert format_size(None) == "-"


def test_parse_duration():
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("1.5h") == 5400
    with pytest.raises(BadInput):
        parse_duration("soon")


def test_parse_int_list_sorts_and_dedups():
    assert parse_int_list("4,1,2,2", flag="--micro-batches") == (1, 2, 4)
    with pytest.raises(BadInput, match="--micro-batches"):
        parse_int_list("1,0", flag="--micro-batches")


def test_parse_margin():
    assert parse_margin("5%") == pytest.approx(0.05)
    assert parse_margin("256MiB") == 256 * 2**20
    assert parse_margin("0") == 0
    with pytest.raises(BadInput):
        parse_margin("150%")
