"""Launchers: what starts a search's workers where the GPUs are (base.py: the seam). `local`
(local.py: processes on this machine, `--workers N`), `ray` (ray_cluster.py: Ray tasks), `slurm`
(slurm.py: a job array). Each starts `autotune worker --study S` processes that pull probes from the
database, and stops them all when the search ends."""

from __future__ import annotations

from autotune.launchers.base import Launcher, WorkerEnd, WorkerSpec

LAUNCHERS = ("local", "ray", "slurm")

__all__ = ["LAUNCHERS", "Launcher", "WorkerEnd", "WorkerSpec"]
