"""Training cases shared by the single-process oracles and the engine running on local ranks."""

from __future__ import annotations

import functools

import torch

from elastic_zero.models import MLP, build_preset, lm_loss
from elastic_zero.zero import SGD, AdamW, ParamGroup, WarmupCosine, ZeroEngine

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and by 4 micro batches per rank share
SEQ = 16

# metric "max_abs": the largest elementwise difference; "relative": ||a - b|| / ||a|| over all
# parameters together. On the GPT, AdamW turns the fp32 reduction-order noise of a few elements
# with near-zero gradients into near-full steps (measured at 3 ranks: 1.35e-5 on 3 of 136k
# elements, 1e-6 overall), so AdamW-on-GPT cases are compared over all parameters together.
CASES = {
    "adamw": dict(model="gpt-nobias", opt="adamw", clip=None, accum=1, metric="relative"),
    "adamw_clip": dict(model="gpt-nobias", opt="adamw", clip=0.05, accum=1, metric="relative"),
    "adamw_accum4": dict(model="gpt-nobias", opt="adamw", clip=None, accum=4, metric="relative"),
    # SGD with momentum on a GPT with biases and a tied head (a parameter shared by two modules)
    "sgd": dict(model="gpt-tied", opt="sgd", clip=None, accum=1, metric="max_abs"),
    "sgd_clip_accum4": dict(model="gpt-tied", opt="sgd", clip=0.5, accum=4, metric="max_abs"),
    "mlp_adamw_clip": dict(model="mlp", opt="adamw", clip=0.3, accum=2, metric="max_abs"),
    # per-group hyperparameters (no decay for 1-D, a slower head) under a warmup + cosine schedule
    "adamw_groups_schedule": dict(model="gpt-nobias", opt="adamw_groups", clip=None, accum=1, metric="relative"),
}


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    if kind == "gpt-nobias":
        return build_preset("gpt-tiny", seed=seed, bias=False)
    if kind == "gpt-tied":
        return build_preset("gpt-tiny", seed=seed, tied_head=True)
    if kind == "mlp":
        torch.manual_seed(seed)
        return MLP((12, 24, 24, 6))
    raise ValueError(kind)


def batches(kind: str, steps: int) -> list:
    g = torch.Generator().manual_seed(1234)
    if kind == "mlp":
        return [(torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randn(GLOBAL_BATCH, 6, generator=g))
                for _ in range(steps)]
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_of(kind: str, model, x, y) -> torch.Tensor:
    out = model(x)
    return torch.nn.functional.mse_loss(out, y) if kind == "mlp" else lm_loss(out, y)


HYPER = dict(adamw=dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1), sgd=dict(lr=0.05, momentum=0.9, weight_decay=0.01))


SCHEDULE = WarmupCosine(warmup_steps=3, total_steps=8, min_ratio=0.1)
HEAD_LR = 3e-4


def engine_optimizer(name: str):
    if name == "adamw_groups":
        return AdamW(**HYPER["adamw"], groups=[ParamGroup("lm_head.*", lr=HEAD_LR)], schedule=SCHEDULE)
    # decay_1d=True: torch's AdamW decays every parameter, so the oracle does too
    return AdamW(**HYPER[name], decay_1d=True) if name == "adamw" else SGD(**HYPER[name])


def torch_optimizer(name: str, model):
    """torch's optimizer (and LR scheduler) with the same hyperparameters."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), **HYPER[name]), None
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), **HYPER[name]), None
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.startswith("lm_head.")], "lr": HEAD_LR},
        {"params": [p for n, p in named if not n.startswith("lm_head.") and p.dim() >= 2]},
        {"params": [p for n, p in named if not n.startswith("lm_head.") and p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, **HYPER["adamw"])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE.scale)


def oracle(case: str, steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch on one process over the same global batches."""
    c = CASES[case]
    model = build_model(c["model"])
    opt, schedule = torch_optimizer(c["opt"], model)
    for x, y in batches(c["model"], steps):
        for mx, my in zip(x.chunk(c["accum"]), y.chunk(c["accum"])):
            (loss_of(c["model"], model, mx, my) / c["accum"]).backward()
        if c["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_engine(process_group, rank: int, case: str, stage: int, seed: int | None = None) -> ZeroEngine:
    c = CASES[case]
    model = build_model(c["model"], seed=rank if seed is None else seed)  # rank 0's weights are broadcast
    return ZeroEngine(model, engine_optimizer(c["opt"]), stage=stage, process_group=process_group,
                      grad_clip=c["clip"])


def train(process_group, rank: int, world: int, case: str, stage: int, steps: int):
    """The same training through ZeroEngine; returns the full state dict and the grad norms."""
    engine = make_engine(process_group, rank, case, stage)
    norms = run_steps(engine, rank, world, case, 0, steps)
    return engine.full_state_dict(), norms


def run_steps(engine: ZeroEngine, rank: int, world: int, case: str, first: int, last: int) -> list:
    """Global steps first..last-1 of `case`, this rank taking its share of each global batch."""
    c = CASES[case]
    norms = []
    seen = watch_forward_inputs(engine)
    for x, y in batches(c["model"], last)[first:]:
        sx, sy = x.chunk(world)[rank], y.chunk(world)[rank]
        micro = list(zip(sx.chunk(c["accum"]), sy.chunk(c["accum"])))
        for i, (mx, my) in enumerate(micro):
            engine.backward(loss_of(c["model"], engine.module, mx, my) / c["accum"], sync=i == len(micro) - 1)
        _check_same_parameters(engine, seen)
        engine.step()
        engine.zero_grad()
        norms.append(engine.last_grad_norm)
    return norms


def watch_forward_inputs(engine: ZeroEngine) -> list:
    """Record, at the moment each unit's forward starts (after the engine's own hook has waited for
    its gather), a digest of the parameters it computes with. The list fills as forwards run."""
    if hasattr(engine, "_forward_digests"):
        return engine._forward_digests
    seen: list = []

    def record(index, module, args) -> None:
        values = engine.units[index].full.double()  # by index: reconfigure() replaces the buffers
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64)
        seen.extend([values.sum().item(), (values * weights).sum().item()])

    for unit in engine.units:  # registered after the engine's hooks, so they run after them
        (unit.module or engine.module).register_forward_pre_hook(functools.partial(record, unit.index))
    engine._forward_digests = seen
    return seen


def _check_same_parameters(engine: ZeroEngine, seen: list) -> None:
    """Every rank must have run this step's forwards with the same full parameters: a rank that
    read a stale or half-gathered buffer shows up here (the digests were taken when each forward
    started, not after the step, when every gather has long landed)."""
    if engine.world_size == 1:
        return
    digest = torch.tensor(seen, dtype=torch.float64)
    low, high = digest.clone(), digest.clone()
    engine.comm.all_reduce(low, op="min")
    engine.comm.all_reduce(high, op="max")
    assert torch.equal(low, high), f"step {engine.step_count}: ranks ran forward with different parameters"
    seen.clear()


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def relative_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    va = torch.cat([a[k].float().flatten() for k in a])
    vb = torch.cat([b[k].float().flatten() for k in a])
    return ((va - vb).norm() / va.norm()).item()


def difference(case: str, a: dict, b: dict) -> float:
    return (max_abs_diff if CASES[case]["metric"] == "max_abs" else relative_diff)(a, b)


def shards_at(step: int, world: int, seed: int = 0) -> list:
    """Every rank's shard of a fresh gpt-tiny (SGD with momentum, stage 1) at `world` ranks, labelled `step`."""
    from elastic_zero.zero import reshard

    engine = ZeroEngine(build_preset("gpt-tiny", seed=seed), SGD(lr=0.1, momentum=0.9), stage=1)
    shards = reshard([engine.shard_state()], world)
    for s in shards:
        s.scalars["step"] = step
    return shards
