"""A joiner's model: a skeleton on the meta device (its initialization never run, init_from's values
never read), a real build where a skeleton would lose a value, and built for real before an engine
would take starting values from it. Oracles: the model built for real from the same seed; the
engine a trained shard fills."""

import pytest
import torch
from torch import nn

from elastic_zero.job.build import build_optimizer
from elastic_zero.job.spec import spec_from_dict
from elastic_zero.worker.initial_model import initial_model
from elastic_zero.worker.worker_model import WorkerModel

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def frozen_embedding():
    """A model with a parameter no shard holds: its value comes from the build."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    model[0].weight.requires_grad_(False)
    return model


def reads_its_weights():
    """A factory that reads a value of its parameters as it builds: it fails on the meta device."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.scale = float(model[0].weight.detach().abs().max())
    return model


def random_buffer():
    """A buffer drawn from torch's generator after a parameter's initialization: the skeleton's
    initializations draw nothing, so its buffer would not be the starters'."""
    model = nn.Sequential(nn.Linear(8, 8))
    model.register_buffer("projection", torch.randn(8, 8))
    return model


def keeps_a_computed_tensor():
    """A tensor computed from a parameter as the model is built: on meta it would hold no value."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.scale = model[0].weight.detach().abs().max()
    return model


class SharedGain(nn.Module):
    """One parameter registered in two modules: one parameter of the model, not two."""

    def __init__(self):
        super().__init__()
        gain = nn.Parameter(torch.ones(8))
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        for block in self.blocks:
            block.gain = gain


def _spec(**model):
    return spec_from_dict({"model": {"preset": "gpt-tiny", **model}, "zero": {"stage": 2}})


def _worker_model(spec, skeleton):
    return WorkerModel(spec, CPU, build_optimizer(spec), initial_model(spec, CPU, skeleton=skeleton))


def _values(engine):
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def test_a_joiners_preset_model_is_a_skeleton_and_a_starters_is_real():
    spec = _spec()
    joiner, starter = initial_model(spec, CPU, skeleton=True), initial_model(spec, CPU)
    assert joiner.skeleton and all(p.device.type == "meta" for p in joiner.model.parameters())
    assert not starter.skeleton and all(p.device.type == "cpu" for p in starter.model.parameters())
    # the same shapes, buffers and tied parameters: what the layout, the memory plan and export read
    assert [(n, p.shape) for n, p in joiner.model.named_parameters()] == \
        [(n, p.shape) for n, p in starter.model.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(joiner.model.buffers(), starter.model.buffers()))
    assert joiner.extra == starter.extra


@pytest.mark.parametrize("factory", ["frozen_embedding", "reads_its_weights", "random_buffer", "keeps_a_computed_tensor"])
def test_a_model_a_skeleton_would_lose_a_value_of_is_built_for_real(factory):
    spec = _spec(preset=None, factory=f"test_joiner_model:{factory}")
    joiner = initial_model(spec, CPU, skeleton=True)
    assert not joiner.skeleton and all(p.device.type == "cpu" for p in joiner.model.parameters())
    torch.manual_seed(spec.train.seed)
    oracle = globals()[factory]()
    assert all(torch.equal(a, b) for a, b in zip(joiner.model.parameters(), oracle.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(joiner.model.buffers(), oracle.buffers()))


def test_a_parameter_shared_by_two_modules_stays_one_in_a_skeleton():
    spec = _spec(preset=None, factory="test_joiner_model:SharedGain")
    joiner, starter = initial_model(spec, CPU, skeleton=True), initial_model(spec, CPU)
    assert joiner.skeleton
    assert [(n, p.shape) for n, p in joiner.model.named_parameters()] == \
        [(n, p.shape) for n, p in starter.model.named_parameters()]
    assert joiner.model.blocks[0].gain is joiner.model.blocks[1].gain and joiner.extra == starter.extra


def test_a_skeleton_is_built_for_real_before_an_engine_takes_starting_values_from_it():
    """A joiner's model never gives values: an engine that starts from the model (a generation that
    starts fresh) gets the job's initial weights, as a starter's does."""
    spec = _spec()
    held = _worker_model(spec, skeleton=True)
    engine = held.new_engine(None)
    assert not held.skeleton
    oracle = _values(_worker_model(spec, skeleton=False).new_engine(None))
    got = _values(engine)
    assert got.keys() == oracle.keys() and all(torch.equal(got[k], oracle[k]) for k in oracle)


def test_a_skeletons_hollow_engine_trains_as_the_shard_that_fills_it():
    spec = _spec()
    trained = _worker_model(spec, skeleton=False).new_engine(None)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def step(engine):
        logits = engine.module(tokens[:, :-1])
        engine.backward(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
        engine.step()
        engine.zero_grad()

    step(trained)
    held = _worker_model(spec, skeleton=True)
    joiner = held.standalone_engine()
    assert held.skeleton and joiner.memory_report()["params"] == 0
    joiner.reconfigure(None, trained.shard_state())
    step(joiner)
    step(trained)
    got, oracle = _values(joiner), _values(trained)
    assert all(torch.equal(got[k], oracle[k]) for k in oracle)


def test_init_from_is_still_checked_by_a_joiner(tmp_path):
    """A skeleton reads no values of the weights to start from, but a file that does not fit the
    model is a joiner's start error as it is a starter's."""
    path = tmp_path / "wrong.pt"
    torch.save({"not.a.parameter": torch.zeros(3)}, path)
    spec = _spec(init_from=str(path))
    for skeleton in (True, False):
        with pytest.raises(Exception, match="model.init_from"):
            initial_model(spec, CPU, skeleton=skeleton)


def test_the_memory_plan_hears_what_the_models_own_tensors_hold():
    """The coordinator takes a worker's own tensors from its RSS to find what else its process holds
    (coordinator/memory_watch.py): a joiner's skeleton holds none, a starter's model all of its own."""
    from elastic_zero.zero.memory_facts import own_tensor_bytes

    spec = _spec()
    joiner, starter = _worker_model(spec, skeleton=True), _worker_model(spec, skeleton=False)
    joiner.standalone_engine()
    assert own_tensor_bytes(joiner.model) == 0
    distinct = {t.data_ptr(): t.nelement() * t.element_size()
                for t in [*starter.model.parameters(), *starter.model.buffers()]}
    assert own_tensor_bytes(starter.model) == sum(distinct.values()) > 0
    sparse = nn.Linear(2, 2)
    sparse.register_buffer("mask", torch.eye(2).to_sparse())  # no storage of its own to ask
    assert own_tensor_bytes(sparse) == (4 + 2) * 4 + 4 * 4  # (a sparse tensor counted as its dense elements)
