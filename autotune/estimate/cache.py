"""Estimates kept on disk, so that a repeated question costs a file read instead of a trace.

One JSON file, `estimates.json` under `autotune.host.paths.cache_dir()`, of at most `MAX_ENTRIES`
estimates keyed by everything that can change the answer (`cache_key`). The cache only saves time:
a missing, damaged or unwritable file means tracing again, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, fields
from pathlib import Path

from autotune.levers.config import ProbeConfig
from autotune.host.environment import package_version
from autotune.vocabulary.errors import AutotuneError
import autotune.estimate.cuda_constants as cuda_constants
from autotune.estimate.stack import Stack
from autotune.estimate.result import MemoryEstimate
from autotune.specs.models import ModelSpec
from autotune.host.paths import cache_dir
from autotune.vocabulary.version import __version__

# Bump when the estimator's method changes, so that cached estimates of the old method are not reused.
ESTIMATOR_VERSION = "e3"  # e2: the eval and generate phases traced, their peaks per phase; e3: per rank
CACHE_FORMAT = 1
MAX_ENTRIES = 512


def cache_key(config: ProbeConfig, device_type: str, spec: ModelSpec, stack: Stack | None = None) -> str:
    """Identity of an estimate: the configuration, the model's architecture, the device type and
    every version that can change the answer (`stack`: the run's, where not the installed ones).
    The model counts by its architecture, not its name: `gpt2` after `models/gpt2-124m` (the same
    config.json) is answered from the cache."""
    fields_but_name = {k: v for k, v in config.key_fields().items() if k != "model"}
    parts = {
        "config": fields_but_name,
        "model": spec.fingerprint,
        "device_type": device_type,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "bitsandbytes": package_version("bitsandbytes"),
        "stack": (stack or Stack()).to_dict(),
        "autotune": __version__,
        "estimator": ESTIMATOR_VERSION,
        # A figure a GPU evidence run measured replaces its assumption: estimates made with it go.
        "cuda_constants": [figure.bytes for figure in cuda_constants.load().values()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class EstimateCache:
    """The estimates file, read once when opened. Each `put` reads the file again before writing,
    so that estimates stored meanwhile by another process are kept."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else cache_dir() / "estimates.json"
        self._entries: dict = _read(self.path).get("entries", {})

    def get(self, key: str, seconds: float) -> MemoryEstimate | None:
        """The stored estimate for `key`, marked cached and taking `seconds`; None when absent."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        try:
            return _from_record(hit["estimate"], seconds)
        except (KeyError, TypeError, ValueError, AutotuneError):
            return None  # a record of another shape: trace again

    def put(self, key: str, estimate: MemoryEstimate) -> None:
        entries = _read(self.path).get("entries", {})
        entries[key] = {"stored": time.time(), "estimate": _to_record(estimate)}
        if len(entries) > MAX_ENTRIES:  # keep the newest
            entries = dict(sorted(entries.items(), key=lambda kv: kv[1].get("stored", 0))[-MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": CACHE_FORMAT, "entries": entries}))
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            pass  # a read-only cache directory costs time, not correctness
        self._entries = entries


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: the cache only saves time, so start afresh
    return data if isinstance(data, dict) and data.get("version") == CACHE_FORMAT else {}


def _to_record(estimate: MemoryEstimate) -> dict:
    data = asdict(estimate)
    data["config"] = estimate.config.to_dict()
    data["notes"] = list(estimate.notes)
    return data


def _from_record(data: dict, seconds: float) -> MemoryEstimate:
    names = {f.name for f in fields(MemoryEstimate)}
    values = {k: v for k, v in data.items() if k in names}
    values.update(
        config=ProbeConfig.from_dict(data["config"]), notes=tuple(data.get("notes", ())), seconds=seconds, cached=True
    )
    return MemoryEstimate(**values)
