"""Run one function on N local processes joined by a gloo process group: a helper of the benchmarks
and the tests, not of the runtime (which runs on Ray).

The parent hosts the TCPStore, so no rank's death takes the rendezvous down. Each child sets
torch to one thread, builds its own process group (no default group) and sends back its result
serialised with torch.save, or its traceback.

The children are forked from a fork server that imported torch once (multiprocessing's
"forkserver", single-threaded, so forking it is safe where forking the caller, with its threads,
is not): a spawned child spent 1.1 s of CPU importing torch, and the test suite starts about a
hundred of them on two cores. Each child takes the caller's environment as it is at the call.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic_zero.wire.rendezvous import loopback_store
from elastic_zero.zero.comm import new_process_group


def _plain_data() -> list:
    """The project's plain-data classes a rank may return (shards, their layouts, checkpoint file
    entries), and nothing else."""
    from elastic_zero.checkpoint.manifest import Block, DataFile, Segment
    from elastic_zero.plan.layout import FlatLayout, ParamSlot, ParamSpec, UnitSpan
    from elastic_zero.plan.partition import Partition, Piece, Range
    from elastic_zero.zero.shard import ShardState

    return [ShardState, FlatLayout, ParamSlot, ParamSpec, UnitSpan, Partition, Piece, Range, DataFile, Segment, Block]


_PLAIN_DATA = _plain_data()


@dataclass
class LocalRank:
    rank: int
    world_size: int
    store: Any  # a torch.distributed.TCPStore client
    process_group: Any


class LocalGroupError(RuntimeError):
    pass


def run_local_group(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    may_exit: tuple[int, ...] = (),
) -> list[Any]:
    """`fn(LocalRank, *args)` on `world_size` processes; the results in rank order.

    Ranks in `may_exit` may end their process early (a fault drill); their result is None."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = loopback_store(timeout_s)
    ctx = _context()
    results_q = ctx.Queue()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, daemon=True,
                    args=(fn, rank, world_size, store.port, args, results_q, backend, threads_per_rank, timeout_s, env))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = results_q.get(timeout=0.5)
            except queue_mod.Empty:
                for i in may_exit:
                    if procs[i].exitcode is not None and i not in results:
                        results[i] = None
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise LocalGroupError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise LocalGroupError(f"local group timed out after {timeout_s:.0f} s") from None
                continue
            if not ok:
                raise LocalGroupError(f"rank {rank} failed:\n{payload}")
            with torch.serialization.safe_globals(_PLAIN_DATA):  # no other class is rebuilt
                results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


_PRELOAD = ["torch", "torch.distributed", "elastic_zero.testing.local_group", "elastic_zero.zero"]


def _context():
    """The fork server's context, its imports set before it first starts (once per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(fn, rank, world_size, port, args, results_q, backend, threads, timeout_s, env) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, now: the fork server's is the one it had when the server started
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
        pg = new_process_group(store, "local/", rank, world_size, backend, timeout_s=timeout_s)
        result = fn(LocalRank(rank, world_size, store, pg), *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        results_q.put((rank, True, buf.getvalue()))
    except BaseException:  # sent to the parent, which raises it as LocalGroupError
        results_q.put((rank, False, traceback.format_exc()))
