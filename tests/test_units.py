import pytest

from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.units import format_size, parse_duration, parse_int_list, parse_margin, parse_size

GiB = 2**30


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("8192MiB", 8 * GiB),
        ("7.5GiB", int(7.5 * GiB)),
        ("8GB", 8 * 10**9),
        ("1024", 1024),
        ("8gib", 8 * GiB),
        ("8G", 8 * GiB),
        (4096, 4096),
    ],
)
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


# -- 64-bit limits: the database stores sizes and counts as signed 64-bit integers -----------------
# (Old code accepted these and SQLite raised OverflowError at the first write.)

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("text", ["9999999TiB", "8388608TiB", str(2**63), 2**63, "99999999999999999999"])
def test_parse_size_refuses_sizes_past_64_bits(text):
    with pytest.raises(BadInput, match="--gpu-budget: .* is too large"):
        parse_size(text)


def test_parse_size_is_exact_up_to_the_limit():
    assert parse_size(str(INT64_MAX)) == INT64_MAX
    assert parse_size("8388607TiB") == 8388607 * 2**40
    with pytest.raises(BadInput, match="not a positive size"):
        parse_size("0.5")  # (old code: 0 bytes)


def test_parse_int_list_refuses_values_past_64_bits_and_empty_lists():
    assert parse_int_list(str(INT64_MAX), flag="--micro-batches") == (INT64_MAX,)
    with pytest.raises(BadInput, match="--micro-batches: 99999999999999999999 is too large"):
        parse_int_list("1,99999999999999999999", flag="--micro-batches")
    for empty in ("", "  ", ",", " , "):
        with pytest.raises(BadInput, match="--block-sizes: the list is empty"):
            parse_int_list(empty, flag="--block-sizes")


@pytest.mark.parametrize(
    "field, flag", [("micro_batch", "--micro-batch"), ("block_size", "--block-size"), ("grad_accum", "--grad-accum")]
)
def test_probe_config_refuses_integers_past_64_bits(field, flag):
    from autotune.levers.config import ProbeConfig

    values = {"model": "gpt2", "micro_batch": 1, "block_size": 64, field: INT64_MAX + 1}
    with pytest.raises(BadInput, match=f"{flag} {INT64_MAX + 1} is too large"):
        ProbeConfig(**values)


@pytest.mark.parametrize(
    "changes, flag",
    [
        ({"micro_batches": (1, INT64_MAX + 1)}, "--micro-batches"),
        ({"block_sizes": (INT64_MAX + 1,)}, "--block-sizes"),
        ({"effective_batch": INT64_MAX + 1}, "--effective-batch"),
        ({"effective_batch": None, "effective_tokens": INT64_MAX + 1}, "--effective-tokens"),
        ({"effective_batch": 0}, "--effective-batch"),
    ],
)
def test_search_space_refuses_integers_past_64_bits(changes, flag):
    from autotune.search.space import SearchSpace

    with pytest.raises(BadInput, match=flag):
        SearchSpace(model="gpt2", **changes)
