"""The engine's reduce-scatter and all-gather on real gloo groups (zero/comm.py): the reduce-scatter is an
all-to-all and a sum, the all-gather gloo's own. Oracle: the sums and concatenations computed by hand
from what every rank put in."""

import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.zero import TorchComm

CHUNK = 1000


def _contribution(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's input: element i is (r + 1) * (i % 13) - r; it and any sum of three are exact in bf16."""
    i = torch.arange(CHUNK * world, dtype=torch.float64)
    return ((rank + 1) * (i % 13) - rank).to(dtype)


def _expected_share(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    whole = sum(_contribution(r, world, torch.float64) for r in range(world))
    return whole[rank * CHUNK:(rank + 1) * CHUNK].to(dtype)


def _collectives(ctx):
    comm = TorchComm(ctx.process_group)
    world, rank = comm.world_size, comm.rank
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        # in place, as the backward does it: the share lands in this rank's chunk of the bucket
        bucket = _contribution(rank, world, dtype)
        share = bucket[rank * CHUNK:(rank + 1) * CHUNK]
        comm.reduce_scatter(share, bucket)
        out[f"in_place_{dtype}"] = torch.equal(share, _expected_share(rank, world, dtype))
    # three in flight at once, as the backward keeps them, then two more: the buffers come back
    buckets = [_contribution(rank, world, torch.float32) * (k + 1) for k in range(3)]
    shares = [torch.empty(CHUNK) for _ in buckets]
    handles = [comm.reduce_scatter(s, b, async_op=True) for s, b in zip(shares, buckets)]
    for h in handles:
        h.wait()
    out["in_flight"] = all(torch.equal(s, _expected_share(rank, world, torch.float32) * (k + 1))
                           for k, s in enumerate(shares))
    kept = {b.data_ptr() for b in comm._scratch._free}
    for _ in range(2):
        comm.reduce_scatter(torch.empty(CHUNK), _contribution(rank, world, torch.float32))
    fp32 = [b for b in comm._scratch._free if b.dtype == torch.float32]
    out["scratch_kept"] = len(fp32) == 3 and {b.data_ptr() for b in comm._scratch._free} == kept
    # the all-gather, in place: this rank's input is its chunk of the output
    full = torch.full((CHUNK * world,), -1.0)
    mine = full[rank * CHUNK:(rank + 1) * CHUNK]
    mine.copy_(torch.arange(CHUNK, dtype=torch.float32) + 1000 * rank)
    comm.all_gather(full, mine)
    out["gathered"] = torch.equal(full, torch.cat([torch.arange(CHUNK, dtype=torch.float32) + 1000 * r
                                                   for r in range(world)]))
    return out


def test_reduce_scatter_and_all_gather_on_gloo_match_the_sums_by_hand():
    for answers in run_local_group(_collectives, 3):
        assert all(answers.values()), answers
