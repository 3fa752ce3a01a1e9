"""The whole model's values through the ranks' shards, both ways: the starting values cut into every
rank's shard, and the full state dict gathered back from all of them. Every rank calls each."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from elastic_zero.zero.comm import agree_on_all_ranks
from elastic_zero.zero.shard_buffers import ShardBuffers
from elastic_zero.zero.unit_buffer import UnitBuffer


def take_starting_values(comm, shard: ShardBuffers, units: Sequence[UnitBuffer], stage: int, device: torch.device,
                         initializer, after_bind: Callable[[UnitBuffer], None]) -> None:
    """Every unit's starting values, a unit at a time. From given weights at stage 3, each rank reads
    only its own range (N ranks read the model once); the parameters the weights lack on purpose (an
    adapter's) take rank 0's initialization, broadcast, those alone. Otherwise rank 0's values are broadcast
    whole: a model's own initialization is random, and at stages 1-2 each rank holds whole units.
    `initializer`: a meta model's (meta.py), or None for a model built with its values."""
    own_ranges = initializer is not None and initializer.init_values is not None and stage == 3
    if own_ranges:  # no broadcast makes them agree: ranks reading different files must not fork
        agree_on_all_ranks(comm, initializer.fingerprint(), device, "weights to start from (init_from)")
    for unit in units:
        if own_ranges:
            made = [slot for _, slot in unit.members if initializer.takes_own_init(slot.name)]
            read_flat = _with_rank_0s_own_init(comm, initializer, made, device) if made else initializer.read_flat
            shard.master_of(unit).copy_(unit.own_initial_values(read_flat))
            unit.bind_params()
        else:
            full32 = unit.initial_values(initializer.values if initializer is not None else None)
            comm.broadcast(full32, 0)
            if not shard.master_is_view:
                shard.master_of(unit).copy_(full32[unit.own_slice])
            unit.take_values(full32)
            del full32
        after_bind(unit)


def _with_rank_0s_own_init(comm, initializer, made, device: torch.device) -> Callable[[str, int, int], torch.Tensor]:
    """A `read_flat` that gives the parameters `made` (slots) the values rank 0's initialization
    made for them, broadcast in one buffer, and reads the others' ranges from the weights. Every rank
    makes them (no file is read for them): a model whose initialization fails fails on every rank
    alike, not on rank 0 while the others wait in the broadcast."""
    values = initializer.values([slot.name for slot in made])
    flat = torch.cat([values[slot.name].reshape(-1).to(device, torch.float32) for slot in made])
    del values
    comm.broadcast(flat, 0)
    starts, at = {}, 0
    for slot in made:
        starts[slot.name], at = at, at + slot.numel

    def read_flat(name: str, lo: int, hi: int) -> torch.Tensor:
        if name in starts:
            return flat[starts[name] + lo : starts[name] + hi]
        return initializer.read_flat(name, lo, hi)
    return read_flat


def gather_state_dict(comm, shard: ShardBuffers, units: Sequence[UnitBuffer], module: nn.Module,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The model's state dict on the host, with the full fp32 parameters gathered from every rank's
    master; the caller has let the gathers that write the units' buffers land."""
    values: dict[int, torch.Tensor] = {}
    for unit in units:
        full32 = torch.empty(unit.padded, device=device)
        comm.all_gather(full32, shard.master_of(unit))
        for p, slot in unit.members:
            start = slot.offset - unit.span.offset
            values[id(p)] = full32[start : start + slot.numel].view(slot.shape).cpu().clone()
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out[name] = values[id(t)] if id(t) in values else t.detach().cpu().clone()
    return out
