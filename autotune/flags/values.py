"""The kinds of values flags take: one click type per kind, one bound each, used by every command and
by the service, which reads a request's fields as these flags (autotune/flags/flag.py)."""

from __future__ import annotations

import math
import re

import click

from autotune.vocabulary.errors import quoted
from autotune.vocabulary.units import INT64_MAX, MAX_STEPS, parse_duration


# -- The kinds of values flags take: one type per kind, one bound each, used by every command --------
# A value is refused where click reads it, before any command body runs: one line, exit status 2,
# nothing looked at or written. Owners of a finer rule (ProbeSettings: at least 2 warm-up steps;
# evaluation: at most 1024 beams) still check it, with its reason.


def _flag(param: click.Parameter | None) -> str:
    return max(param.opts, key=len) if param is not None and param.opts else "the value"


class WholeNumber(click.ParamType):
    """A whole number from `minimum` to `maximum`, in ASCII digits ('1_000', '2.0', '1e3' are refused)."""

    name = "integer"

    def __init__(self, minimum: int, maximum: int, why: str) -> None:
        self.minimum, self.maximum, self.why = minimum, maximum, why

    def convert(self, value, param, ctx):
        flag = _flag(param)
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not re.fullmatch(r"[+-]?[0-9]+", text, re.ASCII):
                raise click.UsageError(
                    f"{flag} {quoted(value)} is not a whole number; give one from {self.minimum} to {self.maximum}", ctx
                )
            # (Past 4300 digits int() refuses to read it: it is out of range either way.)
            number = int(text) if len(text) <= 400 else (-1 if text.startswith("-") else 1) * 10**400
        if number < self.minimum:
            raise click.UsageError(
                f"{flag} must be a whole number of at least {self.minimum} (got {quoted(number)})", ctx
            )
        if number > self.maximum:
            raise click.UsageError(
                f"{flag} must be a whole number from {self.minimum} to {self.maximum} "
                f"(got {quoted(number)}): {self.why}",
                ctx,
            )
        return number


class Real(click.ParamType):
    """A finite number (nan, inf and 1e309 are refused), above 0 where `positive`, at most `maximum`."""

    name = "float"

    def __init__(self, *, positive: bool = False, maximum: float | None = None, why: str = "") -> None:
        self.positive, self.maximum, self.why = positive, maximum, why

    def convert(self, value, param, ctx):
        flag = _flag(param)
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise click.UsageError(f"{flag} {quoted(value)} is not a finite number; give a number such as 0.5", ctx)
        if self.positive and number <= 0:
            raise click.UsageError(f"{flag} must be above 0 (got {quoted(value)})", ctx)
        if self.maximum is not None and number > self.maximum:
            raise click.UsageError(f"{flag} must be at most {self.maximum} (got {quoted(value)}): {self.why}", ctx)
        return number


class Seconds(click.ParamType):
    """A duration (90, 90s, 15m, 1.5h) read by units.parse_duration: finite, positive (or 0 where
    `allow_zero`), at most MAX_SECONDS. `name` keeps each flag's --help as it was (FLOAT or TEXT)."""

    def __init__(self, name: str, *, allow_zero: bool = False) -> None:
        self.name, self.allow_zero = name, allow_zero

    def convert(self, value, param, ctx):
        from autotune.vocabulary.errors import BadInput

        try:
            return parse_duration(
                value if isinstance(value, float) else str(value).strip(), flag=_flag(param), allow_zero=self.allow_zero
            )
        except BadInput as exc:
            raise click.UsageError(str(exc).rstrip("."), ctx) from None


class Device(click.ParamType):
    """auto, cpu, cuda or cuda:N; cuda only where a CUDA device may be seen (told without torch)."""

    name = "text"

    def convert(self, value, param, ctx):
        from autotune.probe.runner import cuda_may_be_visible

        flag = _flag(param)
        device = str(value).strip().lower()
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", device, re.ASCII):
            raise click.UsageError(f"{flag} {quoted(value)} is not supported; use auto, cpu, cuda or cuda:N", ctx)
        if device.startswith("cuda") and not cuda_may_be_visible():
            raise click.UsageError(
                f"{flag} {device}: no CUDA device can be seen here (no NVIDIA device node, or "
                f"CUDA_VISIBLE_DEVICES hides them all); use --device cpu, or run it where the GPU is",
                ctx,
            )
        return device


class HostPort(click.ParamType):
    """HOST:PORT where torchrun's ranks meet: a host name or address ([::1] in brackets) and a port
    from 1 to 65535 (0 would be any free port, which the other nodes cannot know)."""

    name = "text"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        host, _, port = text.rpartition(":")
        if not (
            re.fullmatch(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]", host, re.ASCII)
            and re.fullmatch(r"[0-9]{1,5}", port, re.ASCII)
            and 1 <= int(port) <= 65535
        ):
            raise click.UsageError(
                f"{_flag(param)} {quoted(value)} is not HOST:PORT with a port from 1 to 65535 (the "
                f"first node's address and a free port, e.g. 10.0.0.1:29500)",
                ctx,
            )
        return text


# Sequences, tokens, labels, ranks, probes, beams: anything counted that reaches the database.
COUNT = WholeNumber(1, INT64_MAX, "the largest whole number the results database stores")
# Optimizer steps: a probe's warm-up and timed steps, a run's steps.
STEPS = WholeNumber(
    1, MAX_STEPS, "more steps than could end within the longest wait the system can set (24 days) at a microsecond each"
)
# A rate or a share (learning rate, dropout, a margin): finite; the flag's owner checks its range.
REAL = Real()
RATE = Real(positive=True)
# Passes over the data: each is at least one optimizer step.
PASSES = Real(positive=True, maximum=MAX_STEPS, why="each pass is at least one step, and steps go up to that")
# A place among counted things that starts at 0 (a node's rank).
INDEX = WholeNumber(0, INT64_MAX, "the largest whole number the results database stores")
DURATION = Seconds("text")  # --timeout, --probe-timeout (90s, 15m)
SECONDS = Seconds("float")  # flags named in seconds (a unit may still be given)
SECONDS_OR_ZERO = Seconds("float", allow_zero=True)
DEVICE = Device()
RENDEZVOUS = HostPort()
