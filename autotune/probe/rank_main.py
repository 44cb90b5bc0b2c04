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

from autotune.host.processes import collector_paused, kill_me_with_parent, watch_parent

RUN_DIR_ENV = "AUTOTUNE_RANK_DIR"
DEVICE_ENV = "AUTOTUNE_RANK_DEVICE"  # cpu, cuda or auto: the device kind the ranks probe on
FAILED_EXIT = 3
STORE_PREFIX = "autotune/result/"


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
    # The agent may have died between starting this rank and the line above (autotune killed -9 as
    # its ranks start: their Python takes a moment to get here): this rank's parent is then whoever
    # adopted it, which would never die. Checked after the tie, so that no death falls between.
    if not _is_agent(agent):
        os._exit(FAILED_EXIT)
    watch_parent(agent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when the ranks stop
    run_dir, rank = os.environ[RUN_DIR_ENV], int(os.environ["RANK"])
    write_whole(os.path.join(run_dir, f"rank-{rank}.pid"), str(os.getpid()).encode())
    return run_dir, rank


def _is_agent(pid: int) -> bool:
    """Whether `pid` is torchrun's agent (True where /proc cannot say: the watchdog still holds)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"torch.distributed.run" in cmdline.read()
    except OSError:
        return not os.path.isdir("/proc/self")


def main() -> None:
    run_dir, rank = tie_to_agent()

    import gc
    import pickle
    from dataclasses import replace

    with collector_paused():
        import torch
        import transformers.modeling_utils  # noqa: F401  (every rank builds a model: its class imports it)

        from autotune.vocabulary import errors
        from autotune.probe.child import run_probe_in_process
        from autotune.probe.distributed import (
            Rank,
            join_process_group,
            leave_process_group,
        )
        from autotune.vocabulary.status import ProbeStatus
    # (What the imports made lives as long as the rank: no collection goes over it again.)
    gc.freeze()

    place = Rank.from_environment()
    assert place is not None
    # One GPU per rank: the launcher's CUDA_VISIBLE_DEVICES are this node's share, LOCAL_RANK picks one.
    kind = os.environ.get(DEVICE_ENV, "auto")
    cuda = kind in ("cuda", "auto") and torch.cuda.is_available()
    device = torch.device("cuda", place.local_rank) if cuda else torch.device("cpu")
    join_process_group(place, device)
    # On the first node the request is in the run's directory; the other nodes' ranks (`autotune
    # node`) have it from rank 0, sent over the process group.
    shared = [None]
    if os.path.exists(path := os.path.join(run_dir, "request.pickle")):  # (every rank of the first node)
        with open(path, "rb") as source:
            shared = [pickle.load(source)]
    if several_nodes():
        torch.distributed.broadcast_object_list(shared, src=0)
    request = shared[0]
    assert request is not None
    request = replace(request, settings=replace(request.settings, device=str(device)), hold_before_timing=False)

    def report(phase: str) -> None:
        if place.rank == 0:
            write_whole(os.path.join(run_dir, "phase"), phase.encode())

    try:
        result = run_probe_in_process(request, report)
    except errors.AutotuneError as exc:
        write_whole(os.path.join(run_dir, f"rank-{rank}.error"), pickle.dumps(exc))
        os._exit(FAILED_EXIT)
    write_whole(os.path.join(run_dir, f"rank-{rank}.result"), pickle.dumps(result))
    if result.status != ProbeStatus.OK:
        if several_nodes():
            _tell_the_first_node(rank, result)
            if place.rank == 0:  # (what other nodes' ranks told before this one's collectives broke)
                for other, told in results_told(place.world_size, rank).items():
                    write_whole(os.path.join(run_dir, f"rank-{other}.result"), told)
        sys.stdout.flush()
        os._exit(FAILED_EXIT)  # (no goodbye collective: the other ranks may be waiting in one)
    if several_nodes():
        # Every rank's result to rank 0, whose run directory the first node's launcher reads.
        results: list = [None] * place.world_size
        torch.distributed.all_gather_object(results, result)
        if place.rank == 0:
            for other, outcome in enumerate(results):
                write_whole(os.path.join(run_dir, f"rank-{other}.result"), pickle.dumps(outcome))
    leave_process_group()


def several_nodes() -> bool:
    """Whether this run's ranks span more than this node (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) < int(os.environ["WORLD_SIZE"])


def _tell_the_first_node(rank: int, result) -> None:
    """Leave a failed result in the rendezvous's store, hosted by the first node, so that its
    launcher reports this rank's out of memory rather than the broken collectives it caused there."""
    import pickle

    import torch.distributed as dist

    try:
        dist.distributed_c10d._get_default_store().set(f"{STORE_PREFIX}{rank}", pickle.dumps(result))  # type: ignore[arg-type]
    except Exception:  # (the store gone with its node: the first node reports what it saw)
        pass


def results_told(world_size: int, own_rank: int) -> dict[int, bytes]:
    """Other nodes' failed results left in the store (see _tell_the_first_node), by rank."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    told = {}
    for other in range(world_size):
        key = f"{STORE_PREFIX}{other}"
        if other != own_rank and store.check([key]):
            told[other] = store.get(key)
    return told


if __name__ == "__main__":
    main()
