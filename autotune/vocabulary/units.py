"""Parsing and printing of memory sizes and durations as users type them."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from autotune.vocabulary.errors import BadInput

# The largest whole number the database stores (SQLite INTEGER, PostgreSQL BIGINT): sizes and counts
# past it are refused where they are parsed, not met as an OverflowError at the first write.
INT64_MAX = 2**63 - 1
# The longest wait autotune can set (one bound for every duration a user gives): a probe's timeout
# and a command's deadline end up in poll(2), through multiprocessing and selectors, whose timeout
# is a C int of milliseconds; a longer one is an OverflowError there (10**20 s, or inf, at once).
MAX_SECONDS = (2**31 - 1) // 1000  # 24 days 20 hours
# The most optimizer steps any count of steps may ask for (one bound for them all): a step takes at
# least a microsecond anywhere, so more could not end within the longest wait.
MAX_STEPS = MAX_SECONDS * 10**6

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, flag: str = "--gpu-budget") -> int:
    """Bytes in a size such as '8GiB', '8 GiB', '8192MiB', '7.5GiB', '8GB' (decimal) or '1024'."""
    if isinstance(text, int):
        value, unit = Decimal(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise BadInput(f"{flag}: cannot read {text!r} as a size; write it like 8GiB, 7.5GiB, 8192MiB or 8GB.")
        # Decimal, not float: exact for every digit typed, however large, so the range check holds.
        value, unit = Decimal(match.group(1)), match.group(2).lower()
        if unit not in _SIZE_UNITS:
            raise BadInput(
                f"{flag}: unknown unit {match.group(2)!r} in {text!r}; use B, KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal)."
            )
    size = int(value * _SIZE_UNITS[unit])
    if size < 1:
        raise BadInput(f"{flag}: {text!r} is not a positive size; give the memory to fit in, e.g. 8GiB.")
    if size > INT64_MAX:
        raise BadInput(f"{flag}: {text!r} is too large; sizes go up to {INT64_MAX} bytes (8 EiB).")
    return size


# The smallest memory budget a command takes: a smaller one holds no model worth probing, and is a
# slip (`1.5`, `8` or `1B` for 8 GiB or 1 GB, a missing unit) rather than a question.
MIN_BUDGET_BYTES = 2**20


def parse_budget(text: str | int, *, flag: str = "--gpu-budget") -> int:
    """A memory budget: a size (parse_size) of at least MIN_BUDGET_BYTES (1 MiB). Every command's
    --gpu-budget is read here."""
    size = parse_size(text, flag=flag)
    if size < MIN_BUDGET_BYTES:
        raise BadInput(
            f"{flag}: {text!r} is {format_size(size)}, too small to train anything in; budgets start at "
            f"1 MiB: give the memory to fit in with its unit, e.g. 8GiB or 512MiB."
        )
    return size


def format_size(n: float | None) -> str:
    """'8.00 GiB'-style text for a byte count (binary units, as nvidia-smi and PyTorch use)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def size_as_read(n: int) -> str:
    """A size as the user typed it and as it is read: '16GB = 14.90 GiB' where it is a whole number of
    decimal megabytes that is no whole number of MiB (typed in decimal units: GB, MB, or bytes), else
    '14.90 GiB'. Told from the bytes alone, so a stored budget reads the same as a typed one."""
    if n <= 0 or n % 10**6 or not n % 2**20:
        return format_size(n)
    unit, scale = ("GB", 10**9) if n >= 10**9 else ("MB", 10**6)
    return f"{(Decimal(n) / scale).normalize():f}{unit} = {format_size(n)}"


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|)\s*$", re.IGNORECASE)
_DURATION_SCALE = {
    "": 1,
    "s": 1,
    "sec": 1,
    "secs": 1,
    "m": 60,
    "min": 60,
    "mins": 60,
    "h": 3600,
    "hr": 3600,
    "hrs": 3600,
}


def parse_duration(text: str | float, *, flag: str = "--timeout", allow_zero: bool = False) -> float:
    """Seconds in a duration such as '90', '90s', '15m', '1.5h': finite, positive (or zero where
    `allow_zero`), and at most MAX_SECONDS. Every duration a user gives is read here."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        match = _DURATION_RE.match(str(text))
        if not match:
            raise BadInput(f"{flag}: cannot read {_quoted(text)} as a duration; write it like 90s, 15m or 2h.")
        seconds = float(match.group(1)) * _DURATION_SCALE[match.group(2).lower()]
    if math.isnan(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise BadInput(
            f"{flag}: {_quoted(text)} must be a {'' if allow_zero else 'positive '}duration"
            f"{' of 0 or more' if allow_zero else ''}, e.g. 15m."
        )
    if seconds > MAX_SECONDS:
        raise BadInput(
            f"{flag}: {_quoted(text)} is too long; durations go up to {MAX_SECONDS} s "
            f"({format_duration(MAX_SECONDS)}), the longest wait the system can set."
        )
    return seconds


def _quoted(text: object) -> str:
    """A value as a message quotes it, cut short (a pasted megabyte stays one short line)."""
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def parse_int_list(text: str, *, flag: str, minimum: int = 1) -> tuple[int, ...]:
    """(1, 2, 4) from '1,2,4'; every value at least `minimum` and at most INT64_MAX. An empty or
    blank text is refused: a flag given with no value must not quietly mean its default."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise BadInput(f"{flag}: {part!r} is not a whole number; give a comma-separated list like 1,2,4.") from None
        if value < minimum:
            raise BadInput(f"{flag}: {value} is below {minimum}; give values of at least {minimum}.")
        if value > INT64_MAX:
            raise BadInput(f"{flag}: {value} is too large; give values of at most {INT64_MAX}.")
        values.append(value)
    if not values:
        raise BadInput(f"{flag}: the list is empty; give a comma-separated list like 1,2,4.")
    return tuple(sorted(set(values)))


TOKEN_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_tokens(text: str | int, *, flag: str = "--tokens") -> int:
    """A count of tokens: 100000000, 100M, 1.5B, 2e9 (K, M, B/G, T: powers of 1,000); at least 1."""
    value = str(text).strip().replace("_", "").replace(",", "")
    scale = TOKEN_SUFFIXES.get(value[-1:].lower(), 1) if value else 1
    number = value[:-1] if scale != 1 else value
    try:
        tokens = float(number) * scale
    except ValueError:
        raise BadInput(f"{flag} {_quoted(text)} is not a count of tokens; give e.g. 100M, 1.5B or 200000000.") from None
    if not math.isfinite(tokens) or tokens < 1:
        raise BadInput(f"{flag} {_quoted(text)}: a run trains at least one token; give e.g. 100M or 1.5B.")
    if tokens > INT64_MAX:
        raise BadInput(f"{flag} {_quoted(text)} is too large; give at most {INT64_MAX:,} tokens.")
    return round(tokens)


def format_tokens(tokens: int) -> str:
    """'100M', '1.5B', '12,345': a count of tokens for people."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{suffix}"
    return f"{tokens:,}"


def parse_choice_list(text: str, *, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """('fp32', 'bf16') from 'fp32,bf16', each checked against `allowed`."""
    values = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part not in allowed:
            raise BadInput(f"{flag}: unknown value {part!r}; choose from {', '.join(allowed)}.")
        if part not in values:
            values.append(part)
    if not values:
        raise BadInput(f"{flag}: the list is empty; choose from {', '.join(allowed)}.")
    return tuple(values)


def parse_margin(text: str, *, flag: str = "--safety-margin") -> int | float:
    """A safety margin: '5%' (a fraction of the budget, returned as 0.05) or a size ('256MiB')."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise BadInput(f"{flag}: cannot read {text!r}; give a percentage like 5% or a size like 256MiB.") from None
        if not 0 <= percent < 100:
            raise BadInput(f"{flag}: {text!r} must be between 0% and 100%.")
        return percent / 100
    if text in ("0", "0B"):
        return 0
    return parse_size(text, flag=flag)


# The CUDA caching allocator hands out blocks in multiples of 512 bytes (at least 512). The CPU
# accountant counts storages the same way, and the estimator's allocator model starts from it.
CUDA_BLOCK_BYTES = 512


def round_to_block(nbytes: int) -> int:
    """A request as the CUDA caching allocator rounds it (0 stays 0: nothing is allocated)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def format_duration(seconds: float) -> str:
    """'45 s', '3m10s', '1h05m': a duration for people."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
