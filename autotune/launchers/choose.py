"""search's launcher flags to a launcher, checked where the flags alone can be (the cluster itself is
asked by the launcher's `check`, before anything is written); and `--dry-run`, the Slurm job script
a search would submit, printed without writing anything."""

from __future__ import annotations

import dataclasses

from autotune.errors import BadInput
from autotune.launchers.base import Launcher, WorkerSpec


def make_launcher(name: str, *, workers: int | None, ray_address: str | None = None, slurm_partition: str | None = None,
                  slurm_time: str | None = None, slurm_parallel: int | None = None,
                  slurm_options: tuple[str, ...] = (), dry_run: bool = False) -> Launcher | None:
    """The launcher `--launcher NAME` asks for; None for local (the fleet makes it, with this
    machine's devices). Flags of another launcher than the one chosen are refused."""
    slurm_given = [flag for flag, value in (("--slurm-partition", slurm_partition), ("--slurm-time", slurm_time),
                                            ("--slurm-parallel", slurm_parallel), ("--slurm-option", slurm_options))
                   if value]
    if name != "slurm" and (slurm_given or dry_run):
        flag = slurm_given[0] if slurm_given else "--dry-run"
        raise BadInput(f"{flag} is for the Slurm launcher; add --launcher slurm, or leave it out.")
    if name != "ray" and ray_address:
        raise BadInput("--ray-address is for the Ray launcher; add --launcher ray, or leave it out.")
    if name == "local":
        return None
    if name == "ray":
        from autotune.launchers.ray_cluster import RayLauncher

        return RayLauncher(ray_address)
    from autotune.launchers.slurm import SlurmLauncher, SlurmOptions

    return SlurmLauncher(SlurmOptions(partition=slurm_partition, time_limit=slurm_time, parallel=slurm_parallel,
                                      extra=tuple(slurm_options)))


def print_dry_run(launcher: Launcher | None, model: str, budget: int, settings, options, workers: int,
                  space_args: dict) -> str:
    """The job script `--launcher slurm` would submit for this search (its study's name and ranks
    worked out as the search works them out), without submitting or writing anything."""
    from autotune.launchers.slurm import SlurmLauncher
    from autotune.search.request import resolve_search

    assert isinstance(launcher, SlurmLauncher)
    if (settings.device or "auto").strip().lower() == "auto":  # (the cluster's nodes have the GPUs, not this one)
        settings = dataclasses.replace(settings, device="cuda")
    request = resolve_search(model, budget, settings=settings, options=options, **space_args)
    kind = "cpu" if (settings.device or "auto").strip().lower() == "cpu" else "cuda"
    return launcher.script(workers, WorkerSpec(request.name, "", kind, request.space.gpus))
