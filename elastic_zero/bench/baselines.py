"""What the benchmarks compare against: torch's DDP, FSDP2 and DCP need a default process group."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

# the same AdamW hyperparameters for every side of a comparison
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


@contextlib.contextmanager
def default_group(ctx, prefix: str):
    """A default gloo group over a local group's store, for the baselines only (the engine gets
    its own group); destroyed on the way out."""
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2(model):
    """FSDP2 over all ranks of the default group, one unit per transformer block, like ZeroEngine's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
