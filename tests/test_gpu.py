"""The GPU path: NCCL groups, the engine on CUDA, aborting a broken communicator. Skipped without CUDA."""

import pytest
import torch

from elastic_zero.testing.local_group import run_local_group
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


# ---- one GPU: what a lent single-GPU machine can check (the two-rank NCCL path rests on the CPU
# proof of the traffic split, tests/test_replication.py, and on the tests above where 2 GPUs exist)

needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_a_gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_on_one_gpu_matches_torch_adamw_under_autocast(stage):
    """bf16 compute, fp32 master and optimizer state, against torch's AdamW on fp32 weights under
    bf16 autocast: equal within bf16's precision."""
    import copy

    from engine_cases import HYPER, batches, build_model, engine_optimizer, loss_of, relative_diff
    from elastic_zero.zero import ZeroEngine

    model = build_model("gpt-nobias").cuda()
    reference = copy.deepcopy(model)
    engine = ZeroEngine(model, engine_optimizer("adamw"), stage=stage, compute_dtype=torch.bfloat16)
    assert engine.device.type == "cuda"
    opt = torch.optim.AdamW(reference.parameters(), **HYPER["adamw"])
    for x, y in batches("gpt-nobias", 10):
        x, y = x.cuda(), y.cuda()
        engine.backward(loss_of("gpt-nobias", engine.module, x, y))
        engine.step()
        engine.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of("gpt-nobias", reference, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    ours = engine.full_state_dict()
    theirs = {k: v.detach().float().cpu() for k, v in reference.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in ours.values())  # the fp32 master, not the bf16 copy
    assert relative_diff(theirs, ours) <= 1e-2


@needs_a_gpu
def test_the_host_copy_of_a_cuda_shard_is_pinned_and_ordered_before_the_next_update():
    from engine_cases import batches, build_model, engine_optimizer, loss_of
    from elastic_zero.zero import ZeroEngine

    engine = ZeroEngine(build_model("gpt-nobias").cuda(), engine_optimizer("adamw"), stage=2)
    data = batches("gpt-nobias", 3)
    for x, y in data[:2]:
        engine.backward(loss_of("gpt-nobias", engine.module, x.cuda(), y.cuda()))
        engine.step()
        engine.zero_grad()
    host, copied = engine.host_shard_state()
    expected = {k: v.cpu() for k, v in engine.shard_state().vectors.items()}
    x, y = data[2]
    engine.backward(loss_of("gpt-nobias", engine.module, x.cuda(), y.cuda()))
    engine.step()  # waits (on the stream) for the copy before it writes the shard
    copied.synchronize()
    for name, v in host.vectors.items():
        assert v.is_pinned() and torch.equal(v, expected[name]), name


@needs_a_gpu
def test_a_closing_summary_on_cuda_is_made_without_a_host_sync_and_read_once_its_copy_is_done():
    """The step loop reads a step's summary a step late (worker/closing_summary.py): making it must
    not make the host wait for the device (torch's sync debug mode raises on an implicit sync)."""
    from elastic_zero.losses import WEIGHT_KEY, batch_totals, step_summary
    from elastic_zero.worker.closing_summary import ClosingSummary

    loss = torch.full((), 3.0, dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(500_000_000)  # the device busy well past the summary's making
        # a weighed source's batch totals go with it (losses.batch_totals), on the device too
        totals = batch_totals([3.0, 1.5], [{WEIGHT_KEY: None}, {WEIGHT_KEY: None}], "cuda")
        reduced = step_summary(True, 2.0, loss, {}, "cuda", save_busy=True)
        summary = ClosingSummary.after_all_reduce(reduced, 5, [], True, 4, first=False, totals=totals)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert totals.device.type == "cuda" and not summary.known_complete()  # (SummaryReader.read checks for an abort)
    assert summary.safe_point_asked and summary.save_busy and not summary.checkpoint_asked
    assert summary.values()[1:3] == [2.0, 3.0] and summary.total_values() == [4.5, 2.0, 2.0]


@needs_a_gpu
def test_a_layout_left_behind_gives_its_pinned_blocks_back():
    """torch keeps a freed pinned block for a later request of its size: once the shard needs blocks
    of another size, the release (at a commit, nothing of the old layout held) gives the old ones back."""
    from elastic_zero.worker.pinned_layouts import PinnedLayouts
    from elastic_zero.zero.host_memory import host_empty, release_pinned_cache

    torch.zeros(1, device="cuda")
    release_pinned_cache()  # what earlier tests left cached
    stats = torch.cuda.host_memory_stats()
    key = next((k for k in ("allocated_bytes.current", "reserved_bytes.current") if k in stats), None)
    if key is None:
        pytest.skip(f"this torch's host_memory_stats() has no pinned bytes: {sorted(stats)[:8]}")
    pins = PinnedLayouts(release_pinned_cache)
    pins.entered(4 << 20)  # 16 MiB a vector
    old = host_empty(4 << 20, torch.float32, pinned=True)
    pins.entered(1 << 20)  # a world four times as large: 4 MiB
    new = host_empty(1 << 20, torch.float32, pinned=True)
    assert not pins.settle(old_layout_held=True)
    del old  # its block stays cached, counted, until the release
    held = torch.cuda.host_memory_stats()[key]
    assert pins.settle(old_layout_held=False)
    assert torch.cuda.host_memory_stats()[key] <= held - (16 << 20) and new.is_pinned()


@needs_a_gpu
def test_a_nccl_group_is_aborted_and_the_next_one_built_in_the_same_process(monkeypatch):
    from elastic_zero.wire.rendezvous import loopback_store
    from elastic_zero.worker.groups import NCCL_ERROR_HANDLING
    from elastic_zero.zero import TorchComm, new_process_group

    monkeypatch.setenv(*NCCL_ERROR_HANDLING)
    store = loopback_store(30)
    first = new_process_group(store, "g0/train/", 0, 1, "nccl", timeout_s=30)
    t = torch.ones(4, device="cuda")
    TorchComm(first, role="train").all_reduce(t)
    first.abort()  # what a survivor does with a broken generation
    second = new_process_group(store, "g1/train/", 0, 1, "nccl", timeout_s=30)
    u = torch.full((4,), 2.0, device="cuda")
    TorchComm(second, role="train").all_reduce(u)
    assert float(t.sum()) == 4.0 and float(u.sum()) == 8.0
    from elastic_zero.zero.comm import TrafficError

    with pytest.raises(TrafficError, match="cuda tensor"):  # the host group is gloo: a CUDA tensor never goes there
        TorchComm(new_process_group(store, "g1/host/", 0, 1, "gloo"), role="host").all_reduce(u)


@needs_a_gpu
def test_a_job_on_one_gpu_trains_like_the_cpu(tmp_path, local_ray):
    """The whole path under Ray (whose local cluster finds the GPU): num_gpus=1, the device from Ray,
    NCCL at world size 1, the host group, the overlapped replicas; oracle: the same job on the CPU."""
    from runtime_jobs import job, relative

    one = dict(workers=1, min_workers=1, max_workers=1)
    code, summary, _, on_gpu = job(tmp_path, "gpu", train={"steps": 30}, elastic={**one, "use_gpu": True})
    assert code == 0, summary.get("error")
    code, on_cpu_summary, _, on_cpu = job(tmp_path, "cpu", train={"steps": 30}, elastic=one)
    assert code == 0 and relative(on_cpu, on_gpu) <= 1e-3
    # CUDA's context is made in the worker's device phase (worker/start_clock.py), which on the CPU is nothing
    on_gpu_start, on_cpu_start = summary["start"]["worker_start_s"], on_cpu_summary["start"]["worker_start_s"]
    assert on_gpu_start["device"] > 10 * on_cpu_start["device"] and on_gpu_start["device"] > 0.01, \
        (on_gpu_start, on_cpu_start)


@needs_a_gpu
def test_weighed_samples_train_on_one_gpu_like_torch_adamw_on_the_cpu(tmp_path, local_ray):
    """A source of known size takes the path the synthetic one does not (losses.batch_totals): each
    step's sample weights summed on the device, the loss scaled by that sum there, the sum checked
    when the step's summary is read a step late. Oracle: torch's AdamW on one CPU process, as in
    test_own_model's CPU test of the same ragged samples."""
    import dataclasses

    import elastic_zero as ez
    from elastic_zero.data.source import open_source
    from elastic_zero.job.spec import DataSpec
    from elastic_zero.losses import next_token_loss
    from elastic_zero.models import build_preset
    from elastic_zero.plan.batches import rank_positions
    from runtime_jobs import relative
    from test_own_model import TINY, _ragged_dataset, _ragged_job

    source = tmp_path / "ragged.parquet"
    _ragged_dataset(source)
    job = _ragged_job(source, "ragged-gpu", workers=1, micro_batch=3)
    job = dataclasses.replace(job, elastic=dataclasses.replace(job.elastic, use_gpu=True))
    result = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "r")))
    assert result.ok, result.error

    model = build_preset("gpt-tiny", seed=0, **TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = open_source(DataSpec(source=str(source)), seed=0, vocab_size=None, seq_len=TINY["seq_len"], collate=None)
    for step in range(3):
        optimizer.zero_grad()
        loss = next_token_loss(model, data.batch(rank_positions(step, 9, 1, 0)))
        loss.backward()
        optimizer.step()
    assert result.metrics["final_loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert relative(model.state_dict(), result.state_dict) < 1e-4


@needs_a_gpu
@pytest.mark.parametrize("stage", [1, 3])
def test_a_meta_model_on_a_gpu_trains_like_the_real_one_and_a_hollow_engine_holds_nothing(stage):
    """A model built on the meta device gets its values unit by unit on the GPU (from given weights),
    trains bit for bit as the same model built there for real, and takes less memory to start; a
    hollow engine (a joiner's) allocates nothing until a shard fills it."""
    from engine_cases import batches
    from elastic_zero.models import build_preset, lm_loss
    from elastic_zero.zero import AdamW, ZeroEngine
    from elastic_zero.zero.meta import meta_init

    kwargs = dict(tied_head=True, vocab_size=4096, d_model=256, n_layer=4)
    weights = build_preset("gpt-tiny", seed=0, **kwargs).state_dict()

    def run(engine):
        for x, y in batches("gpt-tied", 3):
            engine.backward(lm_loss(engine.module(x.cuda()), y.cuda()))
            engine.step()
            engine.zero_grad()
        return engine.full_state_dict()

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    real = ZeroEngine(build_preset("gpt-tiny", seed=0, **kwargs).cuda(), AdamW(lr=1e-2), stage=stage)
    real_peak = torch.cuda.max_memory_allocated() - base
    expected = run(real)
    del real
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with meta_init():
        model = build_preset("gpt-tiny", seed=0, **kwargs)
    meta = ZeroEngine(model, AdamW(lr=1e-2), stage=stage, device="cuda", init_values=weights)
    meta_peak = torch.cuda.max_memory_allocated() - base
    got = run(meta)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert meta_peak < real_peak, (meta_peak, real_peak)
    before = torch.cuda.memory_allocated()
    with meta_init():
        joiner = ZeroEngine(build_preset("gpt-tiny", seed=0, **kwargs), AdamW(lr=1e-2), stage=stage, device="cuda",
                            hollow=True)
    assert torch.cuda.memory_allocated() == before
    joiner.reconfigure(None, meta.shard_state())
    after_joiner, after_meta = run(joiner), run(meta)
    for name in after_meta:
        assert torch.equal(after_joiner[name], after_meta[name]), name


@needs_a_gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_lora_model_trains_its_adapters_on_a_gpu_like_torch_adamw_and_leaves_the_base_alone(tmp_path, stage):
    """examples/finetune_hf's LoRA Llama in the engine on CUDA: only the adapters train, exactly as torch's
    AdamW on them alone; the frozen weights stay bit-equal to the start."""
    transformers = pytest.importorskip("transformers")
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples.finetune_hf.model import llama_config, with_lora
    from elastic_zero.zero import AdamW, ZeroEngine

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(hidden_size=64, layers=2, seq_len=32)).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(5)).cuda()

    def loss_of(model):
        logits = model(input_ids=ids[:, :-1]).logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))

    torch.manual_seed(1)
    reference = with_lora(str(tmp_path), rank=4, alpha=8.0).cuda()
    torch.manual_seed(1)
    model = with_lora(str(tmp_path), rank=4, alpha=8.0).cuda()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = ZeroEngine(model, AdamW(lr=1e-2, weight_decay=0.0), stage=stage)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        engine.backward(loss_of(engine.module))
        engine.step()
        engine.zero_grad()
        loss_of(reference).backward()
        opt.step()
        opt.zero_grad()
    got, want = engine.full_state_dict(), reference.state_dict()
    assert max((got[k].float().cpu() - want[k].float().cpu()).abs().max().item() for k in want) < 1e-4
    assert all(torch.equal(dict(model.named_parameters())[n].detach(), v) for n, v in frozen.items())
    assert min(want[k].abs().max().item() for k in want if k.endswith("lora_B")) > 0  # the adapters trained
