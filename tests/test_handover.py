"""Shards move between processes without Ray: a planned leave, and a real crash recovered from the
buddy's replica. Oracle: plain PyTorch on one process over the same global batches."""

import datetime
import os
import threading

import torch
import torch.distributed as dist

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.plan.membership import Member, place_buddies
from elastic_zero.plan.partition import partition_layout
from elastic_zero.worker.handover import hand_over
from elastic_zero.worker.replica import ReplicaStore, exchange
from elastic_zero.zero import TorchComm, new_process_group
from engine_cases import difference, make_engine, oracle, run_steps

CASE, STAGE, FIRST, TOTAL = "sgd", 2, 3, 6


def _planned_leave(ctx):
    """3 ranks train, rank 2 hands its shard over and leaves, ranks 0 and 1 go on."""
    engine = make_engine(ctx.process_group, ctx.rank, CASE, STAGE)
    run_steps(engine, ctx.rank, 3, CASE, 0, FIRST)
    snap = engine.shard_state()
    new = partition_layout(snap.layout, 2)
    mine = hand_over(TorchComm(ctx.process_group), snap.partition, new, [0, 1, 2], [0, 1], {ctx.rank: snap}, snap)
    if ctx.rank == 2:
        assert mine is None
        return None
    pg = new_process_group(ctx.store, "g1/", ctx.rank, 2)
    engine.reconfigure(pg, mine)
    run_steps(engine, ctx.rank, 2, CASE, FIRST, TOTAL)
    return engine.full_state_dict()


def test_planned_leave_hands_the_shard_over():
    out = run_local_group(_planned_leave, 3, timeout_s=120)
    assert out[2] is None
    assert difference(CASE, oracle(CASE, TOTAL), out[0]) <= 1e-5


def _abort_when_a_survivor_fails(ctx):
    """What the coordinator does in a job: once one survivor reports the failed step, every
    survivor's group is aborted. A survivor blocked on a peer that already left the collective
    would otherwise wait for gloo's timeout (seen: over 30 s under CI's load)."""
    own_client = dist.TCPStore("127.0.0.1", ctx.store.port, None, False,  # a wait holds its client's lock
                               timeout=datetime.timedelta(seconds=120))
    own_client.wait(["step-failed"])
    ctx.process_group.abort()


def _crash_and_recover(ctx):
    """Rank 1's process dies in step FIRST; the survivors see the collective fail, restore the
    committed snapshot of step FIRST, take rank 1's ranges from its buddy and go on as 2 ranks."""
    members = [Member(f"a{r}", node=f"n{r}") for r in range(3)]
    buddies = place_buddies(members)
    engine = make_engine(ctx.process_group, ctx.rank, CASE, STAGE)
    comm = TorchComm(ctx.process_group)
    replicas = ReplicaStore()
    for step in range(FIRST):
        run_steps(engine, ctx.rank, 3, CASE, step, step + 1)
        snap = engine.shard_state()
        replicas.add(engine.step_count, snap, exchange(comm, snap, buddies)[0])
    if ctx.rank == 1:
        os._exit(1)
    threading.Thread(target=_abort_when_a_survivor_fails, args=(ctx,), daemon=True).start()
    failed = None
    try:
        run_steps(engine, ctx.rank, 3, CASE, FIRST, FIRST + 1)
    except Exception as exc:  # the collective with the dead rank errors
        failed = type(exc).__name__
        ctx.store.set("step-failed", "1")
    assert failed is not None, "the step with a dead peer did not fail"
    engine.discard_partial_step()
    survivors = [0, 2]
    new_rank = survivors.index(ctx.rank)
    pg = new_process_group(ctx.store, "g1/", new_rank, 2, timeout_s=60)
    holder_of_old = [survivors.index(r) if r in survivors else survivors.index(buddies[r]) for r in range(3)]
    ward = buddies.index(ctx.rank)
    held = {ctx.rank: replicas.own[FIRST], ward: replicas.ward[FIRST]}
    snap = replicas.own[FIRST]
    mine = hand_over(TorchComm(pg), snap.partition, partition_layout(snap.layout, 2), holder_of_old,
                     [0, 1], held, snap)
    engine.reconfigure(pg, mine)
    assert engine.step_count == FIRST
    run_steps(engine, new_rank, 2, CASE, FIRST, TOTAL)
    return engine.full_state_dict(), failed


def test_crash_recovers_from_the_buddy_replica():
    out = run_local_group(_crash_and_recover, 3, timeout_s=120, may_exit=(1,))
    assert out[1] is None
    state, failed = out[0]
    assert difference(CASE, oracle(CASE, TOTAL), state) <= 1e-5
    assert torch.equal(torch.cat([v.flatten() for v in state.values()]),
                       torch.cat([v.flatten() for v in out[2][0].values()]))
