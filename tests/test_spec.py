import sys

import pytest

from elastic_zero.job.spec import SpecError, load_spec, spec_from_dict

EXAMPLE = "examples/jobs/tiny.toml"


def test_example_spec_loads_and_overrides_apply():
    spec = load_spec(EXAMPLE, ["train.steps=12", "model.preset=gpt-small", "zero.stage=3"])
    assert spec.name == "tiny" and spec.train.steps == 12 and spec.model.preset == "gpt-small"
    assert spec.zero.stage == 3 and spec.elastic.workers == 3
    assert spec.faults[0].action == "kill" and spec.faults[0].rank == 1 and spec.faults[0].at_step == 10
    assert spec.optimizer.lr == 1e-3 and isinstance(spec.optimizer.weight_decay, float)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"zero": {"stage": 4}}, "zero.stage: got 4; allowed: 1, 2, 3"),
        ({"zero": {"stages": 2}}, "zero.stages: unknown field; allowed: stage, compute_dtype"),
        ({"train": {"steps": "ten"}}, "train.steps: must be an integer, got 'ten'"),
        ({"train": {"steps": 0}}, "train.steps: must be >= 1, got 0"),
        ({"elastic": {"workers": 5, "max_workers": 4}}, "elastic.workers: must lie in [min_workers, max_workers]"),
        ({"optimizer": {"name": "adam"}}, "optimizer.name: got 'adam'; allowed: 'adamw', 'sgd'"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: must be two numbers"),
        ({"model": {"preset": "gpt-huge"}}, "model.preset: got 'gpt-huge'"),
        ({"model": {"preset": None, "factory": "nocolon"}}, "model.factory: must look like"),
        ({"faults": [{"at_step": 3, "action": "explode", "rank": 0}]}, "faults[0].action: got 'explode'"),
        ({"faults": [{"at_step": 3, "action": "kill"}]}, "faults[0].rank: is required for action 'kill'"),
        ({"faults": [{"at_step": 3, "action": "kill_in_handover"}]},
         "faults[0].rank: is required for action 'kill_in_handover'"),
        ({"faults": [{"at_step": 3, "action": "kill_after_handover"}]},
         "faults[0].rank: is required for action 'kill_after_handover'"),
        ({"faults": [{"action": "kill", "rank": 1}]}, "faults[0].at_step: is required"),
        ({"faults": [{"at_step": 99, "action": "kill", "rank": 1}]}, "faults[0].at_step: must be < train.steps"),
        ({"checkpoint": {"every": 5}}, "checkpoint.uri: is required"),
        ({"trian": {}}, "trian: unknown section"),
        ({"elastic": {"use_gpu": "yes"}}, "elastic.use_gpu: must be true or false"),
        ({"model": {"preset": "gpt-tiny", "factory": "a.b:c"}}, "model: give one of 'preset' and 'factory', not both"),
        ({"model": {"wrap": "LlamaDecoderLayer"}}, "model.wrap: must be a list"),
        ({"train": {"loss": 3}}, "train.loss: must be 'package.module:function' or a callable, got 3"),
        ({"train": {"loss": "nocolon"}}, "train.loss: must look like 'package.module:function'"),
        ({"train": {"steps": 5, "epochs": 2}}, "train.epochs: give one of 'steps' and 'epochs', not both"),
        ({"data": {"collate": "a.b:c"}}, "data.collate: applies to Arrow/Parquet data"),
        ({"data": {"source": "x.parquet", "columns": []}}, "data.columns: must be a non-empty list"),
        ({"elastic": {"heartbeat_timeout_s": 0.1}}, "elastic.heartbeat_timeout_s: must be 0 (off) or >= 0.4"),
        ({"elastic": {"heartbeat_timeout_s": -1}}, "elastic.heartbeat_timeout_s: must be >= 0.0"),
        ({"elastic": {"worker_labels": ["spot"]}}, "elastic.worker_labels: must be a table"),
        ({"elastic": {"worker_labels": {"ray.io/market-type": 1}}},
         "elastic.worker_labels.ray.io/market-type: must be a non-empty label value (a string), got 1"),
        ({"elastic": {"worker_resources": {"spot": 0}}}, "elastic.worker_resources.spot: must be a number > 0, got 0"),
        ({"elastic": {"worker_resources": {"spot": "one"}}},
         "elastic.worker_resources.spot: must be a number > 0, got 'one'"),
        ({"elastic": {"worker_resources": {"GPU": 1}}}, "elastic.worker_resources.GPU: is set by the job"),
    ],
)
def test_every_bad_field_is_named(data, message):
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_scale_outside_the_jobs_range_is_refused_and_the_ends_are_in_it():
    from elastic_zero.job.sections import scale_refusal

    assert scale_refusal(9, 1, 4) == "scale to 9: outside [min_workers, max_workers] = [1, 4]"
    assert scale_refusal(0, 1, 4) == "scale to 0: outside [min_workers, max_workers] = [1, 4]"
    assert [scale_refusal(n, 1, 4) for n in (1, 2, 4)] == [None] * 3


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(str(bad))
    with pytest.raises(SpecError, match="expected section.key=value"):
        load_spec(None, ["steps=3"])


def test_a_factory_needs_no_preset_and_python_shortcuts_make_the_same_spec():
    """From TOML a factory alone is enough (the preset default used to get in the way); from Python
    a section may be a table, the model a callable or a name, the data a path."""
    from elastic_zero.job.spec import JobSpec

    spec = load_spec(None, ["model.factory=examples.hf_llama.model:build", "model.kwargs={vocab_size = 64}"])
    assert spec.model.preset is None and spec.model.factory == "examples.hf_llama.model:build"
    assert spec.model.kwargs == {"vocab_size": 64}
    assert spec_from_dict({}).train.steps == 40 and spec_from_dict({"train": {"epochs": 2}}).train.steps is None

    def build():
        return None

    job = JobSpec(model=build, data="rows.parquet", train={"steps": 7, "loss": build}).validate()
    assert job.model.factory is build and job.data.source == "rows.parquet" and job.train.loss is build
    assert JobSpec(model="gpt-small").model.preset == "gpt-small"
    assert JobSpec(model="pkg.mod:fn").model.factory == "pkg.mod:fn"
    assert job.with_steps(9).train.steps == 9
    with pytest.raises(SpecError, match="train: must be a TrainSpec or a table, got int"):
        JobSpec(train=3)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"factory": "no_such_module_here:build"}},
         "model.factory: cannot import 'no_such_module_here' (ModuleNotFoundError"),
        ({"model": {"factory": "json:no_such_fn"}}, "model.factory: module 'json' has no 'no_such_fn'"),
        ({"train": {"loss": "json:__doc__"}}, "train.loss: 'json:__doc__' is a str, not a function"),
        ({"model": {"init_from": "/no/such/weights.pt"}}, "model.init_from: no such file or directory"),
    ],
)
def test_preflight_names_what_cannot_be_had(data, message):
    from elastic_zero.job.preflight import preflight

    with pytest.raises(SpecError) as info:
        preflight(spec_from_dict(data))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_preflight_reads_the_datasets_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elastic_zero.job.preflight import preflight

    pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "rows.parquet")
    pq.write_table(pa.table({"tokens": pa.array([], pa.list_(pa.int32()))}), tmp_path / "empty.parquet")
    with pytest.raises(SpecError, match="data.column: 'tokens' is not a column of .*rows.parquet.* \\(it has: ids\\)"):
        preflight(spec_from_dict({"data": {"source": str(tmp_path / "rows.parquet")}}))
    with pytest.raises(SpecError, match="data.source: .*empty.parquet.* no rows"):
        preflight(spec_from_dict({"data": {"source": str(tmp_path / "empty.parquet")}}))
    with pytest.raises(SpecError, match="data.collate: cannot import 'nope'"):
        preflight(spec_from_dict({"data": {"source": str(tmp_path / "rows.parquet"), "collate": "nope:fn"}}))


def test_init_from_loads_a_plain_state_dict_and_names_what_does_not_fit(tmp_path):
    import torch

    from elastic_zero.checkpoint import load_initial_weights, load_into
    from elastic_zero.models import build_preset

    source, target = build_preset("gpt-tiny", seed=1), build_preset("gpt-tiny", seed=2)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    load_into(target, load_initial_weights(str(tmp_path / "w.pt")))
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    with pytest.raises(ValueError, match="model.init_from: the weights do not fit the model: missing"):
        load_into(build_preset("gpt-tiny", n_layer=3), load_initial_weights(str(tmp_path / "w.pt")))
    (tmp_path / "junk.pt").write_bytes(b"not a state dict")
    with pytest.raises(ValueError, match="model.init_from: cannot read .*junk.pt.* as a state dict"):
        load_initial_weights(str(tmp_path / "junk.pt"))
    with pytest.raises(ValueError, match="model.init_from: .* no committed checkpoint"):
        load_initial_weights(str(tmp_path))


def test_new_params_may_be_missing_from_init_from_and_keep_the_models_own_values(tmp_path):
    """Oracle: the source's weights for every parameter it has, the target's own for the new ones."""
    import torch

    from elastic_zero.checkpoint import load_initial_weights, load_into
    from elastic_zero.models import build_preset

    source, target = build_preset("gpt-tiny", n_layer=1, seed=1), build_preset("gpt-tiny", n_layer=2, seed=2)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    own = {k: v.clone() for k, v in target.state_dict().items()}
    weights = load_initial_weights(str(tmp_path / "w.pt"))
    with pytest.raises(ValueError, match=r"model.init_from: the weights do not fit the model: missing \['blocks.1"):
        load_into(target, weights)  # without new_params: refused, nothing half-loaded
    assert all(torch.equal(own[k], v) for k, v in target.state_dict().items())
    load_into(target, weights, new_params=["blocks.1.*"])
    for name, value in target.state_dict().items():
        assert torch.equal(value, own[name] if name.startswith("blocks.1.") else source.state_dict()[name]), name
    with pytest.raises(ValueError, match=r"model.new_params: '\*.lora_A' matches no parameter of the model"):
        load_into(target, weights, new_params=["blocks.1.*", "*.lora_A"])
    with pytest.raises(SpecError, match="model.new_params: applies only with model.init_from"):
        spec_from_dict({"model": {"new_params": ["*.lora_A"]}})
    with pytest.raises(SpecError, match="model.new_params: must be a list of parameter-name patterns"):
        spec_from_dict({"model": {"init_from": "w.pt", "new_params": [""]}})


def test_a_python_job_is_checked_like_toml_and_keeps_the_users_objects():
    import functools

    from elastic_zero.models import GPTConfig
    from elastic_zero.job.spec import JobSpec, ModelSpec, OptimizerSpec

    config = GPTConfig(vocab_size=64)
    job = JobSpec(model=ModelSpec(factory=functools.partial(print), kwargs={"config": config}, wrap=("Block",)),
                  optimizer=OptimizerSpec(betas=(0.9, 0.99)))
    same = job.normalized()
    assert same.model.kwargs["config"] is config  # passed on as it is, not taken apart into a dict
    assert same.model.wrap == ["Block"] and same.optimizer.betas == [0.9, 0.99]
    with pytest.raises(SpecError, match="train.global_batch: must be an integer, got 8.0"):
        JobSpec(train={"global_batch": 8.0})
    with pytest.raises(SpecError, match="model.preset: got 'gpt-tinny'"):
        JobSpec(model="gpt-tinny").validate()


def test_callables_outside_installed_packages_travel_by_value():
    import functools

    import ray.cloudpickle as cloudpickle

    from elastic_zero.job.user_code import ship_by_value

    ship_by_value(functools.partial(_a_local_function, 2), "pkg.mod:fn", None)
    assert cloudpickle.cloudpickle._is_registered_pickle_by_value(sys.modules[__name__])


def _a_local_function(x):
    return x


def test_a_gpu_job_names_what_the_cluster_has_when_it_has_no_gpu():
    from elastic_zero.job.preflight import check_cluster

    gpu = spec_from_dict({"elastic": {"use_gpu": True}})
    with pytest.raises(SpecError, match=r"^elastic.use_gpu: true needs GPUs, but the Ray cluster has none "
                                        r"\(6 CPU\); add GPU nodes or set elastic.use_gpu = false$"):
        check_cluster(gpu, {"CPU": 6.0, "memory": 2e9, "node:__internal_head__": 1.0})
    check_cluster(gpu, {"CPU": 6.0, "GPU": 2.0})
    check_cluster(spec_from_dict({}), {"CPU": 6.0})  # a CPU job asks nothing of the GPUs


def test_the_spec_module_keeps_its_public_names():
    """The job spec moved into elastic_zero/job/; what users write still works (docs/service.md)."""
    import elastic_zero as ez
    from elastic_zero.spec import load_spec as by_old_path

    assert ez.spec.load_spec is by_old_path is load_spec and ez.SpecError is SpecError
