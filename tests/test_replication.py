"""Replication over the host group, overlapped with the next step, and the split between the groups.

Oracles: the buddy's own snapshot (what the ward's copy must equal), the engine's shard_state()
(what the host copy must equal), and the clock of the training thread (the replica must have
arrived before the next steps ended, and a lost buddy must fail the exchange long before the
group's timeout)."""

import os
import time

import pytest
import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.wire.rendezvous import loopback_store
from elastic_zero.worker.device import cuda_index
from elastic_zero.worker.faults import is_device_failure
from elastic_zero.worker.replication import Replicator
from elastic_zero.zero import TorchComm, ZeroEngine, new_process_group
from elastic_zero.zero.comm import TrafficError
from elastic_zero.zero.host_memory import host_copy, host_empty, is_host_buffer
from engine_cases import make_engine, run_steps

CASE = "adamw"
TIMEOUT_S = 60.0


def _groups(ctx):
    train = TorchComm(ctx.process_group, role="train")
    host = TorchComm(new_process_group(ctx.store, "host/", ctx.rank, ctx.world_size, timeout_s=TIMEOUT_S), role="host")
    return train, host


def _overlapped(ctx, stage):
    train, host = _groups(ctx)
    engine = make_engine(train, ctx.rank, CASE, stage)
    run_steps(engine, ctx.rank, 2, CASE, 0, 1)
    snapshot, copied = engine.host_shard_state()
    rows = [(0, ctx.rank, 12 * ctx.rank, 12)]
    replicator = Replicator()
    flight = replicator.start(host, engine.step_count, snapshot, copied, [1, 0], rows)
    run_steps(engine, ctx.rank, 2, CASE, 1, 4)  # the next steps train while the replica travels
    steps_ended = time.perf_counter()
    assert replicator.finish() is flight
    ward, ward_log = flight.result
    return {"own": snapshot.vectors, "ward": ward.vectors, "ward_rank": ward.rank, "ward_log": ward_log.tolist(),
            "arrived_before_the_steps_ended": flight.arrived_at < steps_ended,
            "ward_is_host_memory": all(is_host_buffer(v) for v in ward.vectors.values())}


@pytest.mark.runtime
@pytest.mark.parametrize("stage", [1, 3])
def test_a_replica_arrives_while_the_next_steps_compute(stage):
    out = run_local_group(_overlapped, 2, (stage,), timeout_s=120)
    for me, buddy in ((0, 1), (1, 0)):
        assert out[me]["ward_rank"] == buddy
        assert out[me]["ward"].keys() == out[buddy]["own"].keys()
        for name, value in out[me]["ward"].items():
            assert torch.equal(value, out[buddy]["own"][name]), name  # the copy as it was after step 1
        assert out[me]["ward_log"] == [[0, buddy, 12 * buddy, 12]]
        assert out[me]["arrived_before_the_steps_ended"] and out[me]["ward_is_host_memory"]


def _buddy_lost(ctx):
    train, host = _groups(ctx)
    engine = make_engine(train, ctx.rank, CASE, 2)
    run_steps(engine, ctx.rank, 2, CASE, 0, 1)
    snapshot, copied = engine.host_shard_state()  # after the step's gathers, with both ranks there
    ctx.store.set(f"trained/{ctx.rank}", "1")
    ctx.store.wait(["trained/0", "trained/1"])
    if ctx.rank == 1:
        os._exit(1)  # gone before its part of the exchange
    replicator = Replicator()
    started = time.monotonic()
    replicator.start(host, engine.step_count, snapshot, copied, [1, 0], [(0, 0, 0, 12)])
    try:
        replicator.finish()
    except Exception as exc:  # the failure of this step's commit
        return {"failed": type(exc).__name__, "after_s": time.monotonic() - started}
    return {"failed": None, "after_s": time.monotonic() - started}


@pytest.mark.runtime
def test_a_buddy_lost_during_the_exchange_fails_the_commit_at_once():
    out = run_local_group(_buddy_lost, 2, timeout_s=120, may_exit=(1,))
    assert out[1] is None
    assert out[0]["failed"] is not None, "the exchange with a dead buddy did not fail"
    assert out[0]["after_s"] < TIMEOUT_S / 3  # the lost connection, not the group's timeout


@pytest.mark.unit
@pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32),
                                         (2, torch.bfloat16)])
def test_the_host_copy_of_a_shard_equals_the_shard(stage, dtype):
    from engine_cases import CASES, batches, build_model, engine_optimizer, loss_of

    engine = ZeroEngine(build_model(CASES[CASE]["model"]), engine_optimizer("adamw"), stage=stage, compute_dtype=dtype)
    run_steps(engine, 0, 1, CASE, 0, 2)
    host, copied = engine.host_shard_state()
    assert copied is None  # on CPU the copy is done on return
    plain = engine.shard_state()
    assert host.scalars == plain.scalars and host.vectors.keys() == plain.vectors.keys()
    for name, v in plain.vectors.items():
        assert torch.equal(host.vectors[name], v), name
        assert is_host_buffer(host.vectors[name])
    run_steps(engine, 0, 1, CASE, 2, 3)  # the copy is a copy: the next step leaves it as it was
    for name, v in plain.vectors.items():
        assert torch.equal(host.vectors[name], v), name
    # the copy a step makes as it updates, before the parameters are published, is the same shard
    x, y = batches(CASES[CASE]["model"], 4)[3]
    engine.backward(loss_of(CASES[CASE]["model"], engine.module, x, y))
    engine.step(host_copy=True)
    engine.zero_grad()
    taken, after = engine.take_host_copy(), engine.shard_state()
    assert taken is not None and taken[0].scalars == after.scalars and engine.take_host_copy() is None  # once
    for name, v in after.vectors.items():
        assert torch.equal(taken[0].vectors[name], v), name


@pytest.mark.unit
def test_each_group_refuses_the_tensors_of_the_other():
    store = loopback_store(10)
    train = TorchComm(new_process_group(store, "t/", 0, 1), role="train")
    host = TorchComm(new_process_group(store, "h/", 0, 1), role="host")
    engine_tensor, buffer = torch.ones(8), host_empty(8, torch.float32)
    buffer.fill_(1.0)
    train.all_reduce(engine_tensor)
    host.all_reduce(buffer)
    host.broadcast(host_copy(engine_tensor)[2:], 0)  # a view of a host buffer is host memory too
    with pytest.raises(TrafficError, match=r"all_reduce of a host buffer \(8 x torch.float32\) on the train group"):
        train.all_reduce(buffer)
    with pytest.raises(TrafficError, match="on the host group .*it carries host buffers only"):
        host.all_reduce(engine_tensor)
    with pytest.raises(TrafficError, match="all_gather of a host buffer"):
        train.all_gather(torch.empty(8), buffer)
    with pytest.raises(ValueError, match="role must be one of"):
        TorchComm(train.pg, role="device")


@pytest.mark.unit
def test_a_gpu_failure_is_told_from_the_jobs_own_errors():
    assert is_device_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_failure(RuntimeError("cudaErrorLaunchFailure: unspecified launch failure"))
    assert not is_device_failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_device_failure(RuntimeError("CUDA error: device-side assert triggered"))  # an index out of range
    assert not is_device_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_device_failure(ValueError("train.loss: returned a non-finite loss"))


@pytest.mark.unit
def test_the_cuda_index_of_the_gpu_ray_assigned():
    assert cuda_index([], None) == 0  # outside Ray: the first visible device
    assert cuda_index([3], "3") == 0  # Ray narrowed CUDA_VISIBLE_DEVICES to the assigned GPU
    assert cuda_index([3], "1,3,5") == 1  # not narrowed: its place among the visible ones
    assert cuda_index([2], None) == 2  # nothing narrowed at all: the id is the index


@pytest.mark.unit
def test_a_tensor_on_the_wrong_group_is_a_bug_not_a_lost_peer():
    from elastic_zero.worker.faults import is_communication_failure

    error = TrafficError("send of a host buffer (8 x torch.float32) on the train group (gloo): it carries device "
                         "tensors only")
    assert not is_communication_failure(error, aborted=False)  # its text names gloo: still the job's bug
    assert is_communication_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer"), False)
