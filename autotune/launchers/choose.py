"""search's launcher flags to a launcher, checked where the flags alone can be (the cluster itself is
asked by the launcher's `check`, before anything is written)."""

from __future__ import annotations

from autotune.vocabulary.errors import BadInput
from autotune.launchers.base import Launcher


def make_launcher(
    name: str,
    *,
    workers: int | None,
    ray_address: str | None = None,
    slurm_partition: str | None = None,
    slurm_time: str | None = None,
    slurm_parallel: int | None = None,
    slurm_options: tuple[str, ...] = (),
    dry_run: bool = False,
) -> Launcher | None:
    """The launcher `--launcher NAME` asks for; None for local (the fleet makes it, with this
    machine's devices). Flags of another launcher than the one chosen are refused."""
    slurm_given = [
        flag
        for flag, value in (
            ("--slurm-partition", slurm_partition),
            ("--slurm-time", slurm_time),
            ("--slurm-parallel", slurm_parallel),
            ("--slurm-option", slurm_options),
        )
        if value
    ]
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

    return SlurmLauncher(
        SlurmOptions(
            partition=slurm_partition, time_limit=slurm_time, parallel=slurm_parallel, extra=tuple(slurm_options)
        )
    )
