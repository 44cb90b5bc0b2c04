"""Data-parallel strategies across ranks: how N processes (one GPU each) share a training run.

A free lever: every strategy trains the same math (each rank takes `micro_batch` sequences per
micro-step, the gradients are averaged over ranks before the optimizer steps), so the search may
choose among those the user allows (`--strategies ddp,fsdp`). What differs is what each rank keeps:

- `ddp`: DistributedDataParallel. Every rank holds the whole model, its gradients (and DDP's
  gradient buckets beside them) and the whole optimizer state; one all-reduce of the gradients.
- `fsdp`: FSDP2 `fully_shard`, parameters resharded after forward (ZeRO-3): each rank keeps
  1/N of parameters, gradients and optimizer state, and all-gathers a layer's parameters for its
  forward and again for its backward; gradients are reduce-scattered.
- `fsdp-grad-op`: the same, parameters kept gathered from forward to backward (ZeRO-2-like,
  `reshard_after_forward=False`): more memory, one all-gather fewer.
- `fsdp-offload`: `fsdp` with parameters, gradients and optimizer state on the host
  (CPUOffloadPolicy): the device holds only the layers being computed; the optimizer steps on CPU.

The model is wrapped as accelerate's FSDP2 path wraps it (each transformer layer a unit, the
input embedding a unit when untied, the final norm and output head one unit kept gathered, then
the root), so that the probe measures what the hand-off (`accelerate launch`, Trainer) runs.
Torch-free: the CLI, the store and the hand-off read these names; `autotune.probe.distributed`
applies them.
"""

from __future__ import annotations

import os

STRATEGIES = ("ddp", "fsdp", "fsdp-grad-op", "fsdp-offload")
FSDP_STRATEGIES = ("fsdp", "fsdp-grad-op", "fsdp-offload")
# The default for a run on several GPUs: what Trainer and accelerate do without an FSDP config.
DEFAULT_STRATEGY = "ddp"


def is_fsdp(strategy: str | None) -> bool:
    return strategy in FSDP_STRATEGIES


def reshards_after_forward(strategy: str) -> bool:
    """Whether a unit's parameters are freed after its forward (and gathered again for backward)."""
    return strategy in ("fsdp", "fsdp-offload")


def offloads(strategy: str | None) -> bool:
    return strategy == "fsdp-offload"


# The most ranks a run can have: torch.distributed takes its world size and ranks as C ints.
MAX_RANKS = 2**31 - 1


def count_problems(gpus: object, nodes: object = 1) -> list[str]:
    """What is wrong with these counts of ranks per node and of nodes (empty: fine)."""
    problems = [
        f"{flag} must be a whole number of at least 1 (got {value!r})"
        for flag, value in (("--gpus", gpus), ("--nodes", nodes))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1
    ]
    if not problems and gpus * nodes > MAX_RANKS:  # type: ignore[operator]
        problems.append(
            f"--gpus x --nodes must be at most {MAX_RANKS}, the most ranks torch.distributed numbers "
            f"(got {gpus} x {nodes})"
        )
    return problems


# CPU ranks per core allowed with --oversubscribe (one per core without it): their timings then share
# the cores. (autotune.search.fleet keeps a copy of this constant for --workers: it should read this one.)
OVERSUBSCRIBE_PER_CORE = 4


def most_cpu_ranks(oversubscribe: bool = False) -> int:
    """The most CPU ranks (probe processes, each computing on the cores) this machine runs at once:
    one per core, OVERSUBSCRIBE_PER_CORE per core with --oversubscribe. The rule --workers follows
    on --device cpu (search.fleet.worker_devices), and --gpus there too."""
    return (os.cpu_count() or 1) * (OVERSUBSCRIBE_PER_CORE if oversubscribe else 1)


def cpu_rank_problems(gpus: int, *, oversubscribe: bool | None = None) -> list[str]:
    """What is wrong with starting `gpus` CPU ranks on this machine for each probe (empty: fine).
    `oversubscribe` None: the command has no --oversubscribe to offer."""
    most = most_cpu_ranks(bool(oversubscribe))
    if gpus <= most:
        return []
    cores = os.cpu_count() or 1
    more = (
        f", or --oversubscribe for up to {most_cpu_ranks(True)} (their timings then share the cores)"
        if oversubscribe is False
        else ""
    )
    return [
        f"--gpus {gpus} on the CPU starts {gpus} ranks on this machine, which has {cores} core"
        f"{'s' if cores != 1 else ''} for them to compute on; give --gpus {most} or fewer{more}"
    ]


def strategy_problems(gpus: int, strategy: str | None, nodes: int = 1) -> list[str]:
    """What is wrong with these ranks and strategy, as one-line problems (empty: fine)."""
    problems = count_problems(gpus, nodes)
    if not problems and gpus * nodes == 1 and strategy is not None:
        problems.append(f"--strategy {strategy} shares a run across ranks: give --gpus 2 or more, or leave it out")
    if strategy is not None and strategy not in STRATEGIES:
        problems.append(f"--strategy {strategy!r} is unknown; choose from {', '.join(STRATEGIES)}")
    return problems


def check_rendezvous(nodes: int, rendezvous: str | None) -> None:
    """BadInput unless a run on several nodes says where they meet, and only such a run does."""
    from autotune.vocabulary.errors import BadInput

    if nodes > 1 and rendezvous is None:
        raise BadInput(
            f"--nodes {nodes} needs --rendezvous HOST:PORT: this node's address and a free port, where the "
            f"other nodes' `autotune node` meet it."
        )
    if nodes == 1 and rendezvous is not None:
        raise BadInput("--rendezvous is where several nodes meet: give --nodes 2 or more, or leave it out.")


def label(gpus: int, strategy: str | None, nodes: int = 1) -> str:
    """' 2xfsdp' for a run on several ranks, ' 2x4xfsdp' on 2 nodes of 4, '' for one."""
    if gpus * nodes == 1:
        return ""
    return f" {nodes}x{gpus}x{strategy}" if nodes > 1 else f" {gpus}x{strategy}"
