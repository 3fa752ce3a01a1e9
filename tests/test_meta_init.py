"""Models built on the meta device: the engine gives each unit its values in turn and never holds
the whole model. Oracles: the same engine on the same weights built for real; the model's own
initialization scheme (its statistics); the tied parameters still one."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elastic_zero.zero import AdamW, ZeroEngine
from elastic_zero.zero.meta import meta_init

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")


def _config(n_layer=2):
    return transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=n_layer, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: runs compare


def _steps(engine, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 96, (4, 17), generator=g)
        out = engine.module(input_ids=tokens[:, :-1]).logits
        engine.backward(nn.functional.cross_entropy(out.reshape(-1, 96), tokens[:, 1:].reshape(-1)))
        engine.step()
        engine.zero_grad()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_meta_model_started_from_given_weights_trains_as_the_real_one(stage):
    torch.manual_seed(0)
    real = transformers.GPT2LMHeadModel(_config())
    weights = {k: v.clone() for k, v in real.state_dict().items()}
    with meta_init():
        meta = transformers.GPT2LMHeadModel(_config())
    assert all(p.device.type == "meta" for p in meta.parameters())
    expected = _steps(ZeroEngine(real, AdamW(lr=1e-2), stage=stage))
    got = _steps(ZeroEngine(meta, AdamW(lr=1e-2), stage=stage, init_values=weights))
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert meta.lm_head.weight is meta.transformer.wte.weight  # the tie survived


def test_a_meta_model_gets_its_own_initialization_unit_by_unit():
    torch.manual_seed(0)
    with meta_init():
        model = transformers.GPT2LMHeadModel(_config(n_layer=4))
    engine = ZeroEngine(model, AdamW(), stage=3)
    state = engine.full_state_dict()
    std = _config().initializer_range
    assert torch.equal(state["transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(state["transformer.h.3.attn.c_attn.bias"], torch.zeros(96))
    assert state["transformer.wte.weight"].std().item() == pytest.approx(std, rel=0.15)
    assert state["transformer.h.1.mlp.c_fc.weight"].std().item() == pytest.approx(std, rel=0.15)
    # GPT-2's own scheme: the residual projections scaled by 1/sqrt(2 * n_layer)
    scaled = state["transformer.h.2.attn.c_proj.weight"].std().item()
    assert scaled == pytest.approx(std / (2 * 4) ** 0.5, rel=0.2)
    # the units differ from each other (no unit was initialized twice from one random state)
    assert not torch.equal(state["transformer.h.0.mlp.c_fc.weight"], state["transformer.h.1.mlp.c_fc.weight"])
    # stage 3: no unit's full buffer is held once the engine is built, and no parameter has bytes of its own
    assert all(u.is_free for u in engine.units)
    assert model.lm_head.weight is model.transformer.wte.weight
    losses = _losses(engine)  # and it trains
    assert losses[-1] < losses[0]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))  # a raw parameter: no reset_parameters() sets it


def test_plain_torch_modules_use_reset_parameters_and_a_module_without_one_is_named():
    with meta_init():
        model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)]))
    engine = ZeroEngine(model, AdamW(), stage=2)
    state = engine.full_state_dict()
    bound = 1 / 8 ** 0.5  # nn.Linear's own init: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert state["0.0.weight"].abs().max() <= bound and state["0.0.weight"].std() > bound / 4
    with meta_init():
        bad = nn.Sequential(nn.ModuleList([_Block()]))
    with pytest.raises(ValueError, match=r"module '0\.0' \(_Block\) has parameters but no reset_parameters"):
        ZeroEngine(bad, AdamW(), stage=3)


def test_meta_buffers_and_frozen_parameters():
    with torch.device("meta"):
        everything = nn.Sequential(nn.ModuleList([nn.BatchNorm1d(4)]))
    with pytest.raises(ValueError, match="buffer '0.0.running_mean' is on the meta device"):
        ZeroEngine(everything, AdamW(), stage=3)
    def build():
        with meta_init():
            model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)]))
        model[0][0].weight.requires_grad_(False)  # frozen: not trained, still needs a value
        return model

    # no shard holds a frozen parameter: only weights to start from can give every worker its value
    with pytest.raises(ValueError, match=r"parameter '0\.0\.weight' is frozen .* start from model.init_from"):
        ZeroEngine(build(), AdamW(), stage=3)
    torch.manual_seed(0)
    weights = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])).state_dict()
    model = build()
    ZeroEngine(model, AdamW(), stage=3, init_values=weights)
    frozen = model[0][0].weight
    assert frozen.device.type == "cpu" and torch.equal(frozen, weights["0.0.weight"])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_hollow_engine_holds_nothing_until_a_shard_fills_it(stage):
    """A worker joining a running job: its engine of its own would hold the whole model's state at
    world size 1; hollow, it holds none, and reconfigure() from a shard gives it the trained state."""
    torch.manual_seed(0)
    trained = ZeroEngine(transformers.GPT2LMHeadModel(_config()), AdamW(lr=1e-2), stage=stage)
    _steps(trained, 2)
    with meta_init():
        joiner = ZeroEngine(transformers.GPT2LMHeadModel(_config()), AdamW(lr=1e-2), stage=stage, hollow=True)
    held = joiner.memory_report()
    assert held["grads"] == held["optimizer"] == 0 and held["params"] == 0
    joiner.reconfigure(None, trained.shard_state())
    assert torch.equal(_steps(joiner, 2, seed=5)["transformer.wte.weight"], _steps(trained, 2, seed=5)["transformer.wte.weight"])


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=6),
       world_size=st.integers(1, 5), align=st.integers(1, 8))
def test_each_ranks_own_range_read_alone_is_its_chunk_of_the_whole_unit(shapes, world_size, align):
    """A ZeRO-3 rank starting from a file reads only its chunk's ranges of each parameter
    (UnitBuffer.own_initial_values); the chunks of every rank, end to end, are the whole unit's
    values as a rank that read every parameter lays them out (initial_values)."""
    from elastic_zero.plan.layout import ParamSpec, build_layout
    from elastic_zero.plan.partition import partition_layout
    from elastic_zero.zero.unit_buffer import UnitBuffer

    specs = [ParamSpec(f"p{i}", tuple(shape), "float32", "u") for i, shape in enumerate(shapes)]
    layout = build_layout(specs, align=align)
    partition = partition_layout(layout, world_size)
    values = {s.name: torch.randn(s.shape) for s in specs}
    reads = []

    def read_flat(name, lo, hi):
        reads.append(hi - lo)
        return values[name].reshape(-1)[lo:hi]

    members = [(nn.Parameter(torch.zeros(s.shape)), s) for s in layout.unit_slots(0)]
    whole = None
    chunks = []
    for rank in range(world_size):
        unit = UnitBuffer(0, layout.units[0], None, members, partition, rank, torch.float32, torch.device("cpu"))
        whole = unit.initial_values(lambda names: {n: values[n] for n in names})
        chunks.append(unit.own_initial_values(read_flat))
    assert torch.equal(torch.cat(chunks), whole)
    assert sum(reads) == sum(v.numel() for v in values.values())  # every element read once, by one rank


def _lacking_block_1(seed=0):
    """A GPT-2's weights less its block 1 (the parameters a fine-tune adds, say), and their names."""
    torch.manual_seed(seed)
    real = transformers.GPT2LMHeadModel(_config())
    lacking = {n for n, _ in real.named_parameters() if n.startswith("transformer.h.1.")}
    return {k: v.clone() for k, v in real.state_dict().items() if k not in lacking}, lacking


@pytest.mark.parametrize("stage", [1, 3])
def test_parameters_the_weights_lack_on_purpose_take_the_models_own_initialization(stage):
    """`model.new_params` on a meta model: the weights to start from give every parameter they hold,
    bit for bit, and the ones they lack on purpose (`own_init`) take GPT-2's own scheme, unit by
    unit. A parameter they lack that is not named is one line naming it. Oracles: the weights; the
    scheme's statistics; the loss going down."""
    weights, lacking = _lacking_block_1()
    with meta_init():
        meta = transformers.GPT2LMHeadModel(_config())
    with pytest.raises(ValueError, match=r"parameter 'transformer\.h\.1\.ln_1\.weight' is not in the weights to start"):
        ZeroEngine(meta, AdamW(), stage=stage, init_values=weights)
    with meta_init():
        meta = transformers.GPT2LMHeadModel(_config())
    engine = ZeroEngine(meta, AdamW(lr=1e-2), stage=stage, init_values=weights, own_init=lacking)
    state = engine.full_state_dict()
    params = {n for n, _ in meta.named_parameters()}
    assert all(torch.equal(state[n], weights[n]) for n in params - lacking)
    assert torch.equal(state["transformer.h.1.ln_1.weight"], torch.ones(32))
    assert torch.equal(state["transformer.h.1.attn.c_attn.bias"], torch.zeros(96))
    std = _config().initializer_range
    assert state["transformer.h.1.mlp.c_fc.weight"].std().item() == pytest.approx(std, rel=0.15)
    assert state["transformer.h.1.mlp.c_proj.weight"].std().item() == pytest.approx(std / 2, rel=0.2)  # 1/sqrt(2 n_layer)
    losses = _losses(engine)
    assert losses[-1] < losses[0]


def _losses(engine, steps=5):
    tokens = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        out = engine.module(input_ids=tokens[:, :-1]).logits
        loss = nn.functional.cross_entropy(out.reshape(-1, 96), tokens[:, 1:].reshape(-1))
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    return losses


def test_a_frozen_parameter_the_weights_lack_is_refused():
    """A frozen parameter is in no shard: only the weights can give every worker its value."""
    weights, lacking = _lacking_block_1()
    with meta_init():
        meta = transformers.GPT2LMHeadModel(_config())
    meta.transformer.h[1].ln_1.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.ln_1\.weight' is frozen .*\(not a model\.new_params one\)"):
        ZeroEngine(meta, AdamW(), stage=3, init_values=weights, own_init=lacking)


def _two_ranks_with_own_init(ctx):
    from elastic_zero.zero import AdamW as ZeroAdamW, ZeroEngine as Engine

    weights, lacking = _lacking_block_1()
    torch.manual_seed(100 + ctx.rank)  # each rank's own random state differs: only a broadcast makes them agree
    with meta_init():
        meta = transformers.GPT2LMHeadModel(_config())
    engine = Engine(meta, ZeroAdamW(), stage=3, process_group=ctx.process_group, init_values=weights, own_init=lacking)
    return engine.full_state_dict()


@pytest.mark.runtime
def test_two_stage_3_ranks_agree_on_the_parameters_that_take_their_own_initialization():
    """At stage 3 each rank reads its own ranges of the weights; a unit with parameters they lack is
    initialized once and broadcast, so ranks whose random states differ still hold one model."""
    from elastic_zero.testing.local_group import run_local_group

    rank0, rank1 = run_local_group(_two_ranks_with_own_init, 2, timeout_s=180)
    weights, lacking = _lacking_block_1()
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[n], rank1[n]) for n in rank0)
    assert all(torch.equal(rank0[n], weights[n]) for n in rank0 if n in weights)
    assert torch.equal(rank0["transformer.h.1.ln_1.weight"], torch.ones(32))


class _Adapter(nn.Module):
    """A PEFT-style adapter around a frozen linear layer: two nn.Linear children, `up` zero at the
    start (so the model begins as the pretrained one), which Hugging Face's _init_weights would
    draw as any other linear layer."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _gpt2_with_adapters(on_meta: bool):
    torch.manual_seed(0)
    if on_meta:
        with meta_init():
            model = transformers.GPT2LMHeadModel(_config())
            for block in model.transformer.h:
                block.mlp.c_fc = _Adapter(nn.Linear(32, 128))
        return model
    model = transformers.GPT2LMHeadModel(_config())
    for block in model.transformer.h:
        block.mlp.c_fc = _Adapter(nn.Linear(32, 128))
    return model


def _adapters_on_two_ranks(ctx, path):
    """A meta GPT-2 with adapters on this rank, started at stage 3 from the safetensors file at `path`
    (the pretrained weights, without the adapters): its weights, and the bytes this rank read of them."""
    from elastic_zero.checkpoint import load_initial_weights
    from elastic_zero.zero import AdamW as ZeroAdamW, ZeroEngine as Engine

    weights = load_initial_weights(path)
    torch.manual_seed(100 + ctx.rank)  # each rank's own random state: only a broadcast makes the adapters agree
    meta = _gpt2_with_adapters(on_meta=True)
    new = {n for n, _ in meta.named_parameters() if ".down." in n or ".up." in n}
    engine = Engine(meta, ZeroAdamW(), stage=3, process_group=ctx.process_group, init_values=weights, own_init=new)
    return engine.full_state_dict(), weights.bytes_read


@pytest.mark.runtime
def test_stage_3_ranks_read_their_own_ranges_of_a_unit_that_mixes_given_and_new_parameters(tmp_path):
    """Adapters in every block: each block's unit holds pretrained weights and new parameters. Each
    rank reads only its own ranges of the pretrained ones from their safetensors file (two ranks: about
    half each, the model once between them); rank 0's adapters are broadcast, they alone. Oracles: the pretrained
    weights bit for bit, the adapters' start (up zero), and the two ranks agreeing."""
    import pyarrow.fs as pafs

    from elastic_zero.checkpoint.safetensors_format import write_all
    from elastic_zero.testing.local_group import run_local_group

    real = _gpt2_with_adapters(on_meta=False)
    pretrained = {k: v for k, v in real.state_dict().items() if ".down." not in k and ".up." not in k}
    path = str(tmp_path / "pretrained.safetensors")
    write_all(pafs.LocalFileSystem(), path, pretrained)
    given = sum(p.numel() * 4 for n, p in real.named_parameters() if n in pretrained)
    (state0, read0), (state1, read1) = run_local_group(_adapters_on_two_ranks, 2, args=(path,), timeout_s=180)
    assert state0.keys() == state1.keys() and all(torch.equal(state0[n], state1[n]) for n in state0)
    for name, value in real.named_parameters():
        if ".down." not in name and ".up." not in name:
            assert torch.equal(state0[name], value), name
    assert all(torch.equal(state0[f"transformer.h.{b}.mlp.c_fc.up.weight"], torch.zeros(128, 4)) for b in range(2))
    assert 0.4 * given < read0 < 0.6 * given and 0.4 * given < read1 < 0.6 * given, (read0, read1, given)


class _Scale(nn.Module):
    """A parameter and no reset_parameters(): nothing can initialize it on the meta device."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.gain


def _refused_on_each_rank(ctx):
    from elastic_zero.zero import AdamW as ZeroAdamW, ZeroEngine as Engine

    weights = {"0.weight": torch.ones(8, 8), "0.bias": torch.zeros(8)}
    with meta_init():
        meta = nn.Sequential(nn.Linear(8, 8), _Scale())
    try:
        Engine(meta, ZeroAdamW(), stage=3, process_group=ctx.process_group, init_values=weights, own_init={"1.gain"})
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.runtime
def test_a_new_parameter_nothing_can_initialize_is_refused_by_every_rank_alike():
    """Rank 0's values are broadcast, but every rank makes them: a model whose initialization fails
    fails on every rank with the same line, rather than on rank 0 while the others wait."""
    from elastic_zero.testing.local_group import run_local_group

    said = run_local_group(_refused_on_each_rank, 2, timeout_s=60)
    assert said[0] == said[1] and "module '1' (_Scale) has parameters but no reset_parameters()" in said[0], said


def test_an_adapter_added_to_a_hugging_face_model_starts_by_its_own_reset_parameters():
    """Hugging Face's _init_weights knows nn.Linear, not what an adapter made of them means: on the
    meta device the adapter's own reset_parameters() has the last word, as its constructor has on
    the CPU (up zero), and its other layers keep HF's scheme. A parameter built for real in a meta
    model, and lacking from the weights, keeps its own values."""
    real = _gpt2_with_adapters(on_meta=False)
    new = {n for n, _ in real.named_parameters() if ".down." in n or ".up." in n}
    weights = {k: v for k, v in real.state_dict().items() if k not in new}
    meta = _gpt2_with_adapters(on_meta=True)
    meta.transformer.h[0].mlp.c_fc.base = nn.Linear(32, 128)  # built for real: it has its values
    built = meta.transformer.h[0].mlp.c_fc.base.weight.detach().clone()
    lacking = new | {"transformer.h.0.mlp.c_fc.base.weight"}
    state = ZeroEngine(meta, AdamW(), stage=3, init_values={k: v for k, v in weights.items() if k not in lacking},
                       own_init=lacking).full_state_dict()
    for block in range(2):
        assert torch.equal(state[f"transformer.h.{block}.mlp.c_fc.up.weight"], torch.zeros(128, 4))
        down = state[f"transformer.h.{block}.mlp.c_fc.down.weight"]
        assert down.std().item() == pytest.approx(_config().initializer_range, rel=0.3)  # HF's scheme
    assert torch.equal(state["transformer.h.0.mlp.c_fc.base.weight"], built)
    assert torch.equal(state["transformer.h.1.mlp.c_fc.base.weight"], weights["transformer.h.1.mlp.c_fc.base.weight"])


def test_meta_init_skips_the_fills_of_meta_tensors_and_keeps_everything_else():
    """A fill on a meta tensor sets nothing, and torch runs some through reference implementations
    whose first use imports its compiler (1.1 s of a worker's start): within meta_init they are
    skipped. What is not a fill still applies: a parameter frozen as it is built stays frozen, a
    buffer gets its value, a fill of a real tensor fills it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MetaOps(TorchDispatchMode):  # the operators torch runs on meta tensors
        def __init__(self):
            super().__init__()
            self.ran = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
                self.ran.append(func.__name__)
            return func(*args, **(kwargs or {}))

    from elastic_zero.models import build_preset

    with meta_init(), MetaOps() as ops:
        build_preset("gpt-small", seed=0)
    assert not [op for op in ops.ran if op.split(".")[0] in ("normal_", "uniform_", "fill_", "zero_")], ops.ran

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))
            nn.init.normal_(self.weight)
            self.weight.requires_grad_(False)
            self.register_buffer("scale", torch.empty(4).fill_(2.0))

    with meta_init():
        model = Frozen()
        real = nn.init.constant_(torch.empty(3), 5.0)
    assert model.weight.device.type == "meta" and not model.weight.requires_grad
    assert torch.equal(model.scale, torch.full((4,), 2.0)) and torch.equal(real, torch.full((3,), 5.0))
