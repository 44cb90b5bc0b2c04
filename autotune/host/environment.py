"""The environment a probe ran in. Two probes are comparable (and a stored one reusable) only when
their environment fingerprints match: same device kind and memory, same driver/CUDA, same library
versions."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from autotune.vocabulary.version import __version__


def package_version(name: str) -> str | None:
    """Installed version of a distribution, read without importing it (importing torch costs seconds)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# The OpenMP settings a step's speed on the host depends on (threads, and whether idle threads spin:
# autotune sets OMP_WAIT_POLICY itself, autotune.host.processes.OPENMP_ENVIRONMENT), kept as the probe's
# process had them set, so that the hand-off starts the run under the same (issue 56).
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def openmp_settings(environ: Any) -> tuple[tuple[str, str], ...]:
    """OPENMP_VARIABLES as set in `environ` (os.environ, say), in that order."""
    return tuple((name, str(environ[name])) for name in OPENMP_VARIABLES if environ.get(name))


def openmp_text(settings: Any) -> str:
    """OpenMP settings (pairs) as a shell would set them: `OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1`."""
    return " ".join(f"{name}={value}" for name, value in settings)


def openmp_of(stored: Any) -> tuple[tuple[str, str], ...]:
    """Environment.openmp from its JSON form (a list of pairs; nothing where not recorded)."""
    return tuple((str(name), str(value)) for name, value in stored or ())


def adopt_openmp(stored: Any) -> None:
    """Make this process's OpenMP variables a study's (`stored`: its environment's `openmp`; None,
    for a study recorded before they were, leaves them), so that the probe children it starts, which
    read them when torch loads, time steps as the study's did: a Ray worker, say, gets
    OMP_NUM_THREADS=1 from Ray where the study's processes had none."""
    if stored is None:
        return
    settings = dict(openmp_of(stored))
    for name in OPENMP_VARIABLES:
        if name in settings:
            os.environ[name] = settings[name]
        else:
            os.environ.pop(name, None)


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
    device_type: str  # 'cuda' or 'cpu'
    device_name: str  # 'NVIDIA H100 80GB HBM3', or 'cpu: <processor>'
    device_total_bytes: int | None  # card memory; host memory on CPU
    cuda_version: str | None = None
    driver_version: str | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    autotune_version: str = __version__
    # The OpenMP settings the probe's process ran under (openmp_settings): they time a CPU step, and
    # the hand-off carries them. Empty where not known (environments recorded before they were).
    openmp: tuple[tuple[str, str], ...] = ()

    def fingerprint(self) -> str:
        data = asdict(self)
        if not data["openmp"]:
            del data["openmp"]  # (so that an environment without them keeps the fingerprint it had)
        canonical = json.dumps(data, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """How this environment differs from `stored` (a study's), one phrase each."""
        ours, theirs = self.to_dict(), {**stored, "openmp": openmp_of(stored.get("openmp"))}
        return [
            f"{key.removesuffix('_version')} {_said(ours.get(key))} here, {_said(theirs.get(key))} in the study"
            for key in ours
            if ours.get(key) != theirs.get(key)
        ]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Environment":
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if "openmp" in values:
            values["openmp"] = openmp_of(values["openmp"])
        return cls(**values)


def _said(value: Any) -> str:
    if isinstance(value, (list, tuple)):  # the OpenMP settings
        return openmp_text(value) or "none set"
    return str(value)
