"""The environment a probe ran in. Two probes are comparable (and a stored one reusable) only when
their environment fingerprints match: same device kind and memory, same driver/CUDA, same library
versions."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from autotune.version import __version__


def package_version(name: str) -> str | None:
    """Installed version of a distribution, read without importing it (importing torch costs seconds)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class Environment:
    device_type: str                 # 'cuda' or 'cpu'
    device_name: str                 # 'NVIDIA H100 80GB HBM3', or 'cpu: <processor>'
    device_total_bytes: int | None   # card memory; host memory on CPU
    cuda_version: str | None = None
    driver_version: str | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    autotune_version: str = __version__

    def fingerprint(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Environment":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
