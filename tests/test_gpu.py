"""The GPU path: NCCL groups, the engine on CUDA, aborting a broken communicator. Skipped without CUDA."""

import pytest
import torch

from elastic_zero.bench.local_group import run_local_group
from engine_cases import difference, oracle

needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _train_on_cuda(ctx, stage):
    from engine_cases import CASES, batches, build_model, engine_optimizer, loss_of
    from elastic_zero.zero import ZeroEngine

    torch.cuda.set_device(ctx.rank)
    c = CASES["sgd"]
    engine = ZeroEngine(build_model(c["model"]).cuda(), engine_optimizer(c["opt"]), stage=stage,
                        process_group=ctx.process_group)
    assert engine.comm.backend == "nccl" and engine.device.type == "cuda"
    for x, y in batches(c["model"], 10):
        sx, sy = x.chunk(2)[ctx.rank].cuda(), y.chunk(2)[ctx.rank].cuda()
        engine.backward(loss_of(c["model"], engine.module, sx, sy))
        engine.step()
        engine.zero_grad()
    return engine.full_state_dict()


@needs_gpus
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_on_two_gpus_matches_torch(stage):
    state = run_local_group(_train_on_cuda, 2, (stage,), backend="nccl", timeout_s=300)[0]
    assert difference("sgd", oracle("sgd", 10), state) <= 1e-4


def _abort_nccl(ctx):
    torch.cuda.set_device(ctx.rank)
    t = torch.ones(4, device="cuda")
    from elastic_zero.zero import TorchComm

    TorchComm(ctx.process_group).all_reduce(t)
    ctx.process_group.abort()  # what a survivor does with a broken generation
    return float(t.sum())


@needs_gpus
def test_a_nccl_group_can_be_aborted():
    assert run_local_group(_abort_nccl, 2, backend="nccl", timeout_s=120) == [8.0, 8.0]
