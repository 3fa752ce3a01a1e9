"""The engine's reduce-scatter and all-gather on real gloo groups (zero/comm.py): below their size limit
an all-to-all and a sum, and gloo's own all-gather; at it, all-reduces in place. Oracle: the sums and
concatenations computed by hand from what every rank put in, and the collectives the group was asked
for."""

import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.zero import TorchComm

CHUNK = 1000


class _Recording:
    """The rank's group, noting the name of each collective asked of it."""

    def __init__(self, group) -> None:
        self._group, self.asked = group, []

    def __getattr__(self, name):
        if name in ("alltoall_base", "allreduce", "_allgather_base", "_reduce_scatter_base"):
            self.asked.append(name)
        return getattr(self._group, name)


def _contribution(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's input: element i is (r + 1) * (i % 13) - r; it and any sum of three are exact in bf16."""
    i = torch.arange(CHUNK * world, dtype=torch.float64)
    return ((rank + 1) * (i % 13) - rank).to(dtype)


def _expected_share(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    whole = sum(_contribution(r, world, torch.float64) for r in range(world))
    return whole[rank * CHUNK:(rank + 1) * CHUNK].to(dtype)


def _collectives(ctx):
    group = _Recording(ctx.process_group)
    comm = TorchComm(group)
    world, rank = comm.world_size, comm.rank
    out = {}
    for limit in (comm.second_buffer_max_bytes, CHUNK * world * 4):  # the default; one just below fp32's bucket
        comm.second_buffer_max_bytes = limit
        for dtype in (torch.float32, torch.bfloat16):
            # in place, as the backward does it: the share lands in this rank's chunk of the bucket
            bucket = _contribution(rank, world, dtype)
            share = bucket[rank * CHUNK:(rank + 1) * CHUNK]
            group.asked.clear()
            comm.reduce_scatter(share, bucket)
            out[f"{limit} {dtype}"] = (torch.equal(share, _expected_share(rank, world, dtype)), list(group.asked))
    # three in flight at once, as the backward keeps them, out of place
    comm.second_buffer_max_bytes = 1 << 20
    buckets = [_contribution(rank, world, torch.float32) * (k + 1) for k in range(3)]
    shares = [torch.empty(CHUNK) for _ in buckets]
    handles = [comm.reduce_scatter(s, b, async_op=True) for s, b in zip(shares, buckets)]
    for h in handles:
        h.wait()
    out["in flight"] = all(torch.equal(s, _expected_share(rank, world, torch.float32) * (k + 1))
                           for k, s in enumerate(shares))
    # the all-gather, in place (this rank's input is its chunk of the output), below and at the limit
    for limit in (1 << 20, CHUNK * world * 4):
        comm.second_buffer_max_bytes = limit
        full = torch.full((CHUNK * world,), -1.0)
        mine = full[rank * CHUNK:(rank + 1) * CHUNK]
        mine.copy_(torch.arange(CHUNK, dtype=torch.float32) + 1000 * rank)
        group.asked.clear()
        comm.all_gather(full, mine)
        out[f"gathered {limit}"] = (torch.equal(full, torch.cat([torch.arange(CHUNK, dtype=torch.float32) + 1000 * r
                                                                 for r in range(world)])), list(group.asked))
    return out


def test_reduce_scatter_and_all_gather_on_gloo_match_the_sums_by_hand():
    limit = 32 << 20
    for answers in run_local_group(_collectives, 3):
        assert answers == {
            f"{limit} torch.float32": (True, ["alltoall_base"]),
            f"{limit} torch.bfloat16": (True, ["alltoall_base"]),
            # the fp32 bucket is at the limit: all-reduced; the bf16 one, half its size, is below it
            "12000 torch.float32": (True, ["allreduce"]),
            "12000 torch.bfloat16": (True, ["alltoall_base"]),
            "in flight": True,
            f"gathered {1 << 20}": (True, ["_allgather_base"]),
            "gathered 12000": (True, ["allreduce"]),
        }, answers
