"""autotune: find the fastest training configuration that fits a GPU's memory, by measuring it.

Importing the package is cheap: torch and transformers load only where a probe, an estimate or a
training run needs them.
"""

from __future__ import annotations

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import AutotuneError
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.version import __version__


def best(study: str | None = None, db: str | None = None):
    """The fastest configuration that fits in `study`: see autotune.handoff.BestConfig."""
    from autotune.handoff import best as _best

    return _best(study, db)


__all__ = ["AutotuneError", "ProbeConfig", "ProbeResult", "__version__", "best"]
