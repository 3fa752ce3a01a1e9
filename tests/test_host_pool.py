"""Reused host blocks (zero/host_pool.py): memory comes back only once nothing can read it.

Oracles: the contents a live view must keep (a block lent again too early would be overwritten),
the block's address (reused or not), and, in a replication of many steps, the buddy's own snapshot
(what each kept replica must equal) beside the pool's count of blocks mapped anew."""

import gc
import threading

import pytest
import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.worker.replica import LayoutReplicas
from elastic_zero.worker.replication import Replicator
from elastic_zero.zero import TorchComm, ZeroEngine, new_process_group
from elastic_zero.zero.host_memory import host_empty, is_host_buffer
from elastic_zero.zero.host_pool import MIN_POOLED_BYTES, FreeBlocks, HostBlockPool
from engine_cases import engine_optimizer

LARGE = MIN_POOLED_BYTES // 4  # float32 elements


def test_free_blocks_keep_a_few_of_each_size_asked_for_lately():
    books = FreeBlocks(per_size=2, horizon=4)
    assert books.take(8) is None and books.take(16) is None  # both sizes asked for: a step's pair
    assert [books.give(8, name) for name in "abc"] == [True, True, False]
    assert books.give(16, "d") and books.free_bytes() == 32
    assert books.take(8) == "b" and books.take(16) == "d"  # the other size's blocks stay meanwhile
    books.give(16, "d")
    assert books.give(32, "x") is False  # a size nobody asked for
    for _ in range(4):
        assert books.take(24) is None  # the layout changed: only 24-byte blocks are asked for now
    assert books.free_bytes() == 0
    assert books.give(8, "a") is False and books.give(24, "e") and books.take(24) == "e"
    books.give(24, "e")
    books.clear()
    assert books.free_bytes() == 0 and books.take(24) is None


def test_a_dead_buffer_is_lent_again_and_a_live_view_keeps_its_block():
    pool = HostBlockPool()
    first = pool.empty(LARGE, torch.float32)
    address = first.data_ptr()
    del first
    gc.collect()
    second = pool.empty(LARGE, torch.float32)
    assert second.data_ptr() == address and (pool.fresh, pool.reused) == (1, 1)

    second.fill_(7.0)
    view = second.detach()[10:20]  # a tensor of its own over the same storage, not holding `second`
    del second  # the view holds the storage: its block must not be lent
    third = pool.empty(LARGE, torch.float32)
    third.fill_(-1.0)
    assert third.data_ptr() != address
    assert torch.equal(view, torch.full((10,), 7.0))
    del view
    gc.collect()
    assert pool.empty(LARGE, torch.float32).data_ptr() == address


def test_a_buffer_dying_on_another_thread_comes_back_and_trim_forgets_it():
    pool = HostBlockPool()
    box = [pool.empty(LARGE, torch.float32)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert pool.free_bytes() == LARGE * 4
    pool.trim()
    assert pool.free_bytes() == 0
    assert pool.empty(LARGE, torch.float32) is not None and pool.fresh == 2


def test_a_buffer_dying_while_its_thread_holds_the_pools_lock_does_not_deadlock():
    """A garbage collection may run inside the pool's locked region and free a pooled tensor in a
    reference cycle: its finalizer runs there, on the thread that holds the lock."""
    pool = HostBlockPool()

    def collect_under_the_lock():
        with pool._lock:
            gc.collect()

    gc.disable()  # so that the cycle is collected under the lock, not before
    try:
        cycle = [pool.empty(LARGE, torch.float32)]
        cycle.append(cycle)
        del cycle
        collector = threading.Thread(target=collect_under_the_lock, daemon=True)
        collector.start()
        collector.join(timeout=10)
    finally:
        gc.enable()
    assert not collector.is_alive()
    assert pool.free_bytes() == LARGE * 4  # and the block came back


def test_small_buffers_and_other_dtypes_are_plain_host_buffers():
    pool = HostBlockPool()
    small = pool.empty(10, torch.float32)
    assert small.shape == (10,) and pool.fresh == 0
    wide = pool.empty(LARGE, torch.float64)
    assert wide.dtype == torch.float64 and wide.numel() == LARGE and pool.fresh == 1
    assert pool.empty(0, torch.int64).numel() == 0


def test_host_empty_uses_the_pool_and_stays_a_known_host_buffer(monkeypatch):
    monkeypatch.setenv("ELASTIC_ZERO_CHECK_TRAFFIC", "1")
    t = host_empty(LARGE, torch.float32)
    assert is_host_buffer(t) and is_host_buffer(t[5:])
    address = t.data_ptr()
    del t
    gc.collect()
    again = host_empty(LARGE, torch.float32)  # the same address, a known host buffer again
    assert again.data_ptr() == address and is_host_buffer(again)


STEPS = 8


def _replicate_every_step(ctx):
    """The trainer's cycle of commits (trainer.py, commits.py): a step's snapshot swapped while the
    next step runs, added to the replicas, the older ones let go once confirmed."""
    from elastic_zero.zero.host_pool import POOL

    train = TorchComm(ctx.process_group, role="train")
    host = TorchComm(new_process_group(ctx.store, "host/", ctx.rank, ctx.world_size, timeout_s=60), role="host")
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # a shard of 2 MB a vector: pooled
    engine = ZeroEngine(model, engine_optimizer("adamw"), stage=1, process_group=train)
    replicas, replicator = LayoutReplicas(), Replicator()
    own_after, fresh_after = {}, []
    for step in range(STEPS):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step * 2 + ctx.rank))
        engine.backward(engine.module(x).pow(2).mean(), sync=True)
        engine.step()
        engine.zero_grad()
        snapshot, copied = engine.host_shard_state()
        own_after[engine.step_count] = {n: v.clone() for n, v in snapshot.vectors.items()}
        flight = replicator.finish()
        if flight is not None:
            replicas.add(0, None, flight.step, flight.snapshot, flight.result[0])
            replicas.confirmed()
        del flight
        replicator.start(host, engine.step_count, snapshot, copied, [1, 0], [])
        del snapshot
        gc.collect()
        fresh_after.append(POOL.fresh)
    flight = replicator.finish()
    replicas.add(0, None, flight.step, flight.snapshot, flight.result[0])
    replicas.confirmed()
    (step, ward), = replicas.current.ward.items()
    return {"fresh_after": fresh_after, "reused": POOL.reused, "own_after": own_after, "ward_step": step,
            "ward": {n: v.clone() for n, v in ward.vectors.items()}}


@pytest.mark.runtime
def test_a_step_a_replication_reuses_its_blocks_and_every_replica_is_the_buddys_snapshot():
    out = run_local_group(_replicate_every_step, 2, timeout_s=120)
    for me, buddy in ((0, 1), (1, 0)):
        step = out[me]["ward_step"]
        assert step == STEPS
        for name, value in out[me]["ward"].items():
            assert torch.equal(value, out[buddy]["own_after"][step][name]), name
        fresh = out[me]["fresh_after"]
        # blocks are mapped for the first steps, until the first replicas are let go; then none
        assert fresh[3:] == [fresh[3]] * (STEPS - 3), fresh
        assert out[me]["reused"] >= 4 * (STEPS - 3), (fresh, out[me]["reused"])
