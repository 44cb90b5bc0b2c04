"""The evidence document, gpu-evidence.json: its header (the card as torch sees it, asked in a child
since the orchestrator does not import torch; the driver; the versions), the earlier command's
document read back from the state (refused when measured on another device or in the other mode),
and its writing into --out and --state after every section, the state packed beside it into a
tarball that gives it back to a fresh GPU machine (docs/gpu-evidence.md).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from autotune.host.environment import package_version
from autotune.vocabulary.version import __version__
from benchmarks.gpu_evidence.common import (
    EVIDENCE_FILE,
    REPO,
    RESULT_MARK,
    STATE_TAR,
    MiB,
    UsageError,
    last_line,
    utc_now,
)

# Kept out of the state's tarball: a full model checkpoint of the training run, caches, scratch.
NOT_TARRED = ("train-run", "handoff-run", "cache", "tmp")
MAX_TARRED_FILE_BYTES = 8 * MiB


def save_document(doc: dict, out: Path, state: Path) -> None:
    """`doc` into `out` and `state` (written whole, then renamed: a kill leaves the previous one), and,
    where they differ, the state packed into `out` (Run.save)."""
    doc["updated"] = utc_now()
    text = json.dumps(doc, indent=1, default=str) + "\n"
    for directory in dict.fromkeys([out, state]):
        tmp = directory / f".{EVIDENCE_FILE}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / EVIDENCE_FILE)
    if out.resolve() != state.resolve():
        pack_state(state, out / STATE_TAR)


def pack_state(state: Path, target: Path) -> None:
    """The state directory as a tarball (its model checkpoints, caches and scratch left out)."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(part in NOT_TARRED for part in parts[1:]) or info.name.endswith(".tmp"):
            return None
        if info.isfile() and info.size > MAX_TARRED_FILE_BYTES:
            return None
        return info

    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(state, arcname=state.name, filter=keep)
    os.replace(tmp, target)


def nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def cuda_device() -> dict:
    """The card as torch sees it, asked in a child (the orchestrator does not import torch). Raises
    UsageError when there is none: no driver, or torch without CUDA."""
    if not (shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia")):
        raise UsageError(
            "no CUDA device here (no NVIDIA driver); run on the GPU machine, or give --cpu for the CPU mode"
        )
    code = "import sys; from benchmarks.gpu_evidence.helpers import helper_main; helper_main(['device_info', '{}'])"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    except subprocess.TimeoutExpired:
        raise UsageError(
            "asking torch for the CUDA device took over 5 minutes; is the card healthy? (nvidia-smi)"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    info = json.loads(lines[-1][len(RESULT_MARK) :]) if lines else {}
    if not info.get("cuda_available"):
        raise UsageError(
            f"torch sees no CUDA device here ({info.get('why') or last_line(done.stderr) or 'no answer'}); "
            f"give --cpu for the CPU mode"
        )
    return info


def helper_device_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False, "why": f"torch {torch.__version__} built for CUDA {torch.version.cuda}"}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda_available": True,
        "device": props.name,
        "device_total_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
    }


def new_document(mode: str, device: dict, argv: Sequence[str]) -> dict:
    from benchmarks.report import slug

    today = utc_now()[:10]
    return {
        "evidence": "autotune's CUDA claims, measured (benchmarks/gpu_evidence.py)",
        "mode": mode,
        "device": device.get("device"),
        "device_total_bytes": device.get("device_total_bytes"),
        "compute_capability": device.get("compute_capability"),
        "driver": nvidia_driver(),
        "cuda": device.get("cuda"),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "python": sys.version.split()[0],
        "autotune_version": __version__,
        "date": utc_now(),
        "updated": utc_now(),
        "host_cpus": os.cpu_count(),
        "command": "python -m benchmarks.gpu_evidence " + shlex.join(argv),
        # Where this document is committed (docs/gpu-evidence.md).
        "results_file": f"benchmarks/results/{slug(str(device.get('device')))}-gpu-evidence-{today}.json",
        "sections": {},
    }


def load_document(state: Path, fresh: dict) -> dict:
    """The earlier run's document from the state (its sections and first date kept), else `fresh`.
    A state measured on another device or in the other mode is refused: mixing them is not evidence."""
    path = state / EVIDENCE_FILE
    if not path.exists():
        return fresh
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{path} is not JSON; move it away or give another --state") from None
    for key in ("mode", "device"):
        if earlier.get(key) != fresh[key]:
            raise UsageError(
                f"{path} holds a run with {key} {earlier.get(key)!r}, not {fresh[key]!r}; give another --state"
            )
    kept = {key: earlier[key] for key in ("date", "results_file") if key in earlier}
    return {**fresh, **kept, "sections": earlier.get("sections", {})}
