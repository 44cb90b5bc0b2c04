"""How a `--device` is read, in one place: the kind of device it names (`device_kind`: a probe's
device type, auto left for the child to decide) and the kind of worker that may run it
(`worker_kind`: auto and cuda:N are GPU workers' work)."""

from __future__ import annotations


def device_kind(device: str | None) -> str:
    """'cpu', 'cuda' or 'auto' (cuda:N is cuda)."""
    text = str(device or "auto").strip().lower()
    return "cuda" if text.startswith("cuda") else text


def worker_kind(device: str | None) -> str:
    """The kind of worker a `--device` asks for: cpu for cpu; else cuda (auto, cuda, cuda:N: the
    workers that run it are where the GPUs are)."""
    return "cpu" if device_kind(device) == "cpu" else "cuda"
