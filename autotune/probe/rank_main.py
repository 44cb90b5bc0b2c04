"""One rank of a multi-rank probe: the process torchrun starts (`-m autotune.probe.rank_main`), one
per GPU (or per CPU process on a machine without one). It runs the probe child's own probe
(`child.run_probe_in_process`) with the model wrapped by the config's strategy, and talks to the
launcher (probe/torchrun.py) through files in the run's directory (RUN_DIR_ENV):

- `rank-R.pid`: written first, so that the launcher can make sure no rank outlives the probe;
- `request.pickle`: the ProbeRequest (read by every rank);
- `phase`: rank 0's phase of the probe (build, warm-up, timing...), for the live line;
- `rank-R.result`: this rank's ProbeResult (or `rank-R.error`, a user error), written whole.

A rank whose probe did not end `ok` (out of memory, a crash, a skip) exits at once with
FAILED_EXIT, leaving every collective: torchrun's agent sees it and stops the other ranks, which
would otherwise wait for it in their next all-gather or all-reduce (the deadlock other tools report).
"""

from __future__ import annotations

import os
import signal
import sys

from autotune.processes import kill_me_with_parent, watch_parent

RUN_DIR_ENV = "AUTOTUNE_RANK_DIR"
FAILED_EXIT = 3


def write_whole(path: str, data: bytes) -> None:
    """Write a file that a reader sees whole or not at all."""
    partial = f"{path}.partial"
    with open(partial, "wb") as out:
        out.write(data)
    os.replace(partial, path)


def tie_to_agent() -> tuple[str, int]:
    """Make this rank die with torchrun's agent, which dies with autotune (the agent starts ranks
    in sessions of their own, so a signal to its group would not reach them), and say its pid to
    the launcher. (run directory, rank); call first, before the heavy imports."""
    agent = os.getppid()
    kill_me_with_parent()
    watch_parent(agent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when the ranks stop
    run_dir, rank = os.environ[RUN_DIR_ENV], int(os.environ["RANK"])
    write_whole(os.path.join(run_dir, f"rank-{rank}.pid"), str(os.getpid()).encode())
    return run_dir, rank


def main() -> None:
    run_dir, rank = tie_to_agent()

    import pickle
    from dataclasses import replace

    from autotune import errors
    from autotune.probe.child import run_probe_in_process
    from autotune.probe.distributed import Rank, join_process_group
    from autotune.status import ProbeStatus

    with open(os.path.join(run_dir, "request.pickle"), "rb") as source:
        request = pickle.load(source)
    place = Rank.from_environment()
    assert place is not None
    # One GPU per rank: the launcher's CUDA_VISIBLE_DEVICES are this node's share, LOCAL_RANK picks one.
    settings = request.settings
    if settings.device_kind in ("cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            settings = replace(settings, device=f"cuda:{place.local_rank}")
        elif settings.device_kind == "auto":
            settings = replace(settings, device="cpu")
    request = replace(request, settings=settings, hold_before_timing=False)

    def report(phase: str) -> None:
        if place.rank == 0:
            write_whole(os.path.join(run_dir, "phase"), phase.encode())

    try:
        import torch

        join_process_group(place, torch.device(settings.device if settings.device_kind != "auto" else "cpu"))
        result = run_probe_in_process(request, report)
    except errors.AutotuneError as exc:
        write_whole(os.path.join(run_dir, f"rank-{rank}.error"), pickle.dumps(exc))
        os._exit(FAILED_EXIT)
    write_whole(os.path.join(run_dir, f"rank-{rank}.result"), pickle.dumps(result))
    if result.status != ProbeStatus.OK:
        sys.stdout.flush()
        os._exit(FAILED_EXIT)  # (no goodbye collective: the other ranks may be waiting in one)
    from autotune.probe.distributed import leave_process_group

    leave_process_group()


if __name__ == "__main__":
    main()
