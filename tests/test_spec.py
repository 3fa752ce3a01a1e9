import pytest

from elastic_zero.spec import SpecError, load_spec, spec_from_dict

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
    ],
)
def test_every_bad_field_is_named(data, message):
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(str(bad))
    with pytest.raises(SpecError, match="expected section.key=value"):
        load_spec(None, ["steps=3"])
