import math

import pytest
import torch

from elastic_zero.zero.optim import SGD, AdamW, Hyper, ParamGroup, fused_adamw
from elastic_zero.zero.schedule import WarmupCosine


def _run(ours, theirs, steps=6, seed=0):
    """Apply our update to flat copies and torch's optimizer to the originals; return both."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = theirs(torch_params)
    flat = [p.clone().reshape(-1) for p in params]
    states = {name: [torch.zeros_like(f) for f in flat] for name in ours.state_names}
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, gr in zip(torch_params, grads):
            p.grad = gr.clone()
        opt.step()
        hyper = Hyper(ours.lr, ours.weight_decay)
        ours.update(flat, [gr.reshape(-1) for gr in grads], states, hyper, step, 1.0)
    return flat, [p.detach().reshape(-1) for p in torch_params]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(wd):
    ours = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, decay_1d=True)
    a, b = _run(ours, lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


class _FusedAdamW(AdamW):
    """AdamW whose update is the fused kernel's, as on a GPU (the CPU has the kernel too)."""

    def update(self, params, grads, states, hyper, step, lr_scale):
        fused_adamw(params, grads, states["exp_avg"], states["exp_avg_sq"], hyper.lr * lr_scale, self.betas,
                    hyper.weight_decay, self.eps, step)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_fused_adamw_a_gpu_runs_matches_the_ops_and_torch(wd):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, decay_1d=True)
    fused, theirs = _run(_FusedAdamW(**kw), lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                                                         weight_decay=wd))
    ops, _ = _run(AdamW(**kw), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for x, y, z in zip(fused, theirs, ops):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
        torch.testing.assert_close(x, z, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.5, dampening=0.3)],
)
def test_sgd_matches_torch(kw):
    ours = SGD(lr=0.05, **kw)
    a, b = _run(ours, lambda ps: torch.optim.SGD(ps, lr=0.05, **kw))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_hyperparameters_per_parameter():
    opt = AdamW(lr=1e-3, weight_decay=0.1, groups=[ParamGroup("head.*", lr=1e-4)])
    assert opt.hyper_for("blocks.0.fc.weight", (4, 4)) == Hyper(1e-3, 0.1)
    assert opt.hyper_for("blocks.0.fc.bias", (4,)) == Hyper(1e-3, 0.0)  # no decay for 1-D by default
    assert opt.hyper_for("head.weight", (4, 4)) == Hyper(1e-4, 0.1)
    assert AdamW(weight_decay=0.1, decay_1d=True).hyper_for("b", (4,)).weight_decay == 0.1
    assert SGD(weight_decay=0.1).hyper_for("b", (4,)).weight_decay == 0.1  # torch's SGD decays all


def test_warmup_cosine_schedule():
    s = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [s.scale(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.scale(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.scale(14) == s.scale(100) == 0.1
    values = [s.scale(i) for i in range(3, 15)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: AdamW(lr=-1), "AdamW lr"),
        (lambda: AdamW(betas=(0.9, 1.0)), "AdamW betas"),
        (lambda: AdamW(eps=0), "AdamW eps"),
        (lambda: SGD(momentum=1.0), "SGD momentum"),
        (lambda: SGD(nesterov=True), "nesterov"),
        (lambda: AdamW(groups=[ParamGroup("x", lr=-1)]), "param group 'x'"),
        (lambda: WarmupCosine(10, 5), "total_steps"),
    ],
)
def test_bad_hyperparameters_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("case", ["adamw_groups_schedule", "sgd"])
def test_updating_the_shard_in_small_batches_changes_no_result(case, monkeypatch):
    """The update runs over batches of at most UPDATE_BATCH_NUMEL elements, to bound AdamW's
    temporaries: batches of 100 elements (pieces of parameters cut mid-way) give the same bits."""
    from elastic_zero.zero import update_groups as module
    from engine_cases import train

    whole, _ = train(None, 0, 1, case, 3, 4)
    monkeypatch.setattr(module, "UPDATE_BATCH_NUMEL", 100)
    batched, _ = train(None, 0, 1, case, 3, 4)
    assert whole.keys() == batched.keys()
    for name in whole:
        assert torch.equal(whole[name], batched[name]), name


def test_update_batches_hold_at_most_the_bound_and_cover_the_shard(monkeypatch):
    from elastic_zero.zero import update_groups as module
    from engine_cases import make_engine

    monkeypatch.setattr(module, "UPDATE_BATCH_NUMEL", 100)
    engine = make_engine(None, 0, "adamw_groups_schedule", 3)
    sizes = [sum(v.numel() for v in views["params"]) for _, views in engine._groups]
    assert max(sizes) <= 100 and len(sizes) > 10
    covered = sum(sizes)
    pieces = sum(p.numel for p in module.shard_pieces(engine.layout, engine.partition, 0))
    assert covered == pieces
