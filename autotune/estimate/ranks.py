"""One rank of a run on several GPUs, traced in the trace child: a fake process group (no other
process, collectives that move nothing), and the model built by the probe's own
`autotune.probe.distributed.build_model`, so that the estimate follows the probe's DDP and FSDP2
layout whenever it changes.

What a trace on fake tensors needs beyond the fake group, each the smallest change that keeps the
memory the real run has:
- the device mesh is made of real tensors (it reads its rank map's values), as the probe makes it;
- DDP's C++ reducer reads the values of the small tensors it makes for its own bookkeeping
  (parameter shapes checked across ranks, the bucket order agreed after the first step): those ops
  make real tensors, of the real sizes, counted as the probe counts them;
- DDP's all-reduce gets a communication hook that hands back the bucket it was given, as an
  all-reduce in place does (the fake group's own work has no result).
Ranks differ only where a parameter's first dimension does not divide among them (FSDP2 gives the
last ranks the smaller shards): then the first and the last rank are traced, else the first only.
"""

from __future__ import annotations

import contextlib

import torch

from autotune.levers import sharding
from autotune.levers.config import ProbeConfig


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process as `rank` of `world_size` in a process group that communicates nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensor_rules(ledger):
    """The changes listed in the module's docstring, for the duration of a rank's trace."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch._C._distributed_c10d import Reducer
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    make_mesh, verify, rebuild = (
        device_mesh.init_device_mesh,
        dist._verify_params_across_processes,
        Reducer._rebuild_buckets,
    )

    def real_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return make_mesh(*args, **kwargs)

    def with_real_factories(function):
        def run(*args, **kwargs):
            ledger.real_factories = True
            try:
                return function(*args, **kwargs)
            finally:
                ledger.real_factories = False

        return run

    device_mesh.init_device_mesh = real_mesh
    dist._verify_params_across_processes = with_real_factories(verify)
    Reducer._rebuild_buckets = with_real_factories(rebuild)
    try:
        yield
    finally:
        device_mesh.init_device_mesh = make_mesh
        dist._verify_params_across_processes = verify
        Reducer._rebuild_buckets = rebuild


def all_reduce_in_place(model) -> None:
    """DDP's all-reduce as a hook that returns the bucket itself (what gloo and NCCL reduce into)."""
    if not hasattr(model, "register_comm_hook"):
        return

    def hook(state, bucket):
        done = torch.futures.Future()  # type: ignore[var-annotated]
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, hook)


def ranks_differ(model, config: ProbeConfig) -> bool:
    """Whether FSDP2 shards some parameter unevenly among the ranks (the last ranks' shards smaller)."""
    if not sharding.is_fsdp(config.strategy):
        return False
    return any(p.dim() > 0 and p.shape[0] % config.ranks for p in model.parameters())
