"""How far `plan`'s speed predictions are from published GPU training throughputs: the error it
states beside its tokens/s, as it states the memory estimator's (estimate/stated_error.py).

The figures live in speed_error.json beside this file, written by `python -m benchmarks.published
--speed` from its table (benchmarks/published/speed.toml: throughputs measured on real cards and
published, each with its configuration and source) and committed with its report
(benchmarks/results/published-speed.md). Torch-free.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = Path(__file__).with_name("speed_error.json")


@dataclass(frozen=True, slots=True)
class SpeedError:
    """Predicted over measured tokens/s, held to `count` published measurements."""

    count: int
    median: float  # median |predicted / measured - 1|
    worst: float  # the largest max(ratio, 1 / ratio)
    source: str = ""

    def text(self) -> str:
        return (
            f"±{self.median:.0%} median, x{self.worst:.2f} at worst, against {self.count} published GPU training "
            f"throughputs"
        )


@functools.cache
def load(path: Path = FILE) -> SpeedError | None:
    """The stated speed error; None where the table has not been run (a checkout before it)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return SpeedError(int(data["count"]), float(data["median"]), float(data["worst"]), str(data.get("source", "")))


def write(error: SpeedError, path: Path = FILE) -> None:
    """Store what the table's run found (benchmarks/published --speed)."""
    path.write_text(json.dumps(asdict(error), indent=1) + "\n")
    load.cache_clear()
