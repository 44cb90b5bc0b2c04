"""The ranks of a run on several GPUs, inside one rank's process: its process group, and the model
wrapped by the config's strategy (autotune.levers.sharding) as accelerate's DDP and FSDP2 paths wrap it.

The probe child (a rank started by torchrun, see probe/ranks.py) and the estimator's trace (one
rank of a fake process group, estimate/trace.py) both build through `build_model`, so that an
estimate follows the probe whenever this file changes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from autotune.levers import sharding
from autotune.levers.config import ProbeConfig
from autotune.specs.models import ModelSpec
from autotune.probe.step import build_random_model

# How long a rank waits in a collective for the others (the process group's timeout). A rank that
# ran out of memory exits at once and torchrun stops the others; this bounds a wait it does not end.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Rank:
    """This process's place among the run's ranks, as torchrun's environment says."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environment(cls) -> "Rank | None":
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def join_process_group(rank: Rank, device: torch.device) -> None:
    """Join the run's process group: NCCL between GPUs, gloo between CPU processes."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=rank.rank,
        world_size=rank.world_size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if cuda else None,
    )


def all_agree(wanted: bool, device: torch.device) -> bool:
    """True when any rank wants it (one small all-reduce): the ranks decide together."""
    import torch.distributed as dist

    flag = torch.tensor([1 if wanted else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def unavailable(config: ProbeConfig, device: torch.device) -> str | None:
    """Why this device cannot run the config's strategy (None: it can)."""
    if sharding.offloads(config.strategy) and device.type != "cuda":
        return (
            "fsdp-offload moves parameters, gradients and optimizer state from the GPU to the host: on a CPU "
            "device there is no device memory for it to save, so it is probed on CUDA only"
        )
    return None


def build_model(spec: ModelSpec, config: ProbeConfig, device: torch.device, trust_remote_code: bool):
    """The probe's random model (probe/step.py) as the config's strategy trains it across the
    process group's ranks (joined, or faked by the estimator); (model, transformers config). Build
    the optimizer after this: FSDP2 replaces the parameters with their shards.

    Under FSDP the model is built on the meta device, sharded, and only then given memory (each
    rank its shards) and initialised, as torchtitan does: a rank never holds the whole model, which
    a 7B full fine-tune on 8 GPUs could not. DDP keeps a whole copy per rank, built where it trains."""
    if not sharding.is_fsdp(config.strategy):
        model, hf_config = build_random_model(spec, config, device, trust_remote_code)
        if config.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # As accelerate builds it for Trainer: the defaults (25 MiB buckets, gradients copied
            # into them: gradient_as_bucket_view off), one device per process.
            model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        return model, hf_config
    model, hf_config = build_random_model(spec, config, torch.device("meta"), trust_remote_code)
    _fully_shard(model, config, device)
    model.to_empty(device="cpu" if sharding.offloads(config.strategy) else device)
    with torch.no_grad():
        model.init_weights()  # (transformers' own initialisation, the rotary tables among the buffers)
    return model, hf_config


def _fully_shard(model: torch.nn.Module, config: ProbeConfig, device: torch.device) -> None:
    """FSDP2 as accelerate's `fsdp2_prepare_model` applies it (transformer-based wrap, its default):
    each of the model's `_no_split_modules` layers a unit; the input embedding a unit of its own
    when untied; the final norm and output head (with the embedding, when tied) one unit kept
    gathered after forward; the root last. Mixed precision as accelerate sets it for bf16/fp16:
    parameters gathered, gradients reduced and outputs made in that dtype (autocast stays on, as
    accelerate wraps the forward in it too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    import torch.distributed as dist

    dtype = _AMP_DTYPES.get(config.precision)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
        if dtype
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy(pin_memory=True) if sharding.offloads(config.strategy) else OffloadPolicy()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reshard = sharding.reshards_after_forward(config.strategy or "")

    def shard(modules, reshard_after_forward: bool | None) -> None:
        fully_shard(
            modules, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard_after_forward
        )

    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in reversed(list(model.modules())[1:]):  # (bottom-up, as accelerate walks them)
        if type(module).__name__ in layer_names and not isinstance(module, FSDPModule):
            shard(module, reshard)
    input_embed = getattr(model, "get_input_embeddings", lambda: None)()
    output_embed = getattr(model, "get_output_embeddings", lambda: None)()
    tied = input_embed is not None and output_embed is not None and input_embed.weight is output_embed.weight
    if not tied and input_embed is not None and not isinstance(input_embed, FSDPModule):
        shard(input_embed, reshard)
    tail = [
        m
        for m in ((_final_norm(model), input_embed, output_embed) if tied else (_final_norm(model), output_embed))
        if m is not None and not isinstance(m, FSDPModule)
    ]
    if tail:
        shard(tail, False)  # (gathered at the end of forward, needed first in backward)
    if not isinstance(model, FSDPModule):
        shard(model, None)  # (torch's own choice for the root: kept gathered)


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The last norm among the base model's direct children (Llama's `model.norm`, GPT-2's
    `transformer.ln_f`), as accelerate finds it."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, torch.nn.Module):
        return None
    found = None
    for _, module in base.named_children():
        if "Norm" in type(module).__name__:
            found = module
    return found
