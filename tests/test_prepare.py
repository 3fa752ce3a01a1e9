"""Preparing a job (job/prepare.py), the one home every launch goes through. Oracle: the fields
the spec's reference names as the user's functions, and a spec JSON carries as it was given."""

import json
import threading

import pytest

import elastic_zero as ez
from elastic_zero.job.prepare import FINAL_CHECKPOINTS, prepare_run, prepare_submission
from elastic_zero.job.spec import SpecError

pytestmark = pytest.mark.unit


def _my_function(*args, **kwargs):
    return None


# what each section needs beside the function (a path on the cluster: a submission does not read it)
_AROUND = {"data": {"source": "/cluster/data/rows.parquet"}, "eval": {"source": "synthetic", "batches": 2}}


def _with(field: str, value) -> ez.Job:
    section, key = field.split(".")
    return ez.Job(name="p", **{section: {key: value, **_AROUND.get(section, {})}})


@pytest.mark.parametrize("field", ["model.factory", "train.loss", "data.collate", "eval.loss"])
def test_every_user_function_given_as_python_to_a_submission_is_one_line_naming_its_field(field):
    assert field in dict(ez.Job(name="p").user_functions())
    with pytest.raises(SpecError) as raised:
        prepare_submission(_with(field, _my_function))
    message = str(raised.value)
    assert message.startswith(f"{field}: a submitted job names its functions as 'pkg.module:fn'") and "\n" not in message
    spec = prepare_submission(_with(field, "my_pkg.module:fn"))  # named: carried as given
    section, key = field.split(".")
    assert json.loads(json.dumps(spec))[section][key] == "my_pkg.module:fn"


def test_an_object_among_a_submitted_factorys_kwargs_is_one_line_naming_the_field():
    job = ez.Job(name="p", model={"factory": "my_pkg.models:build", "kwargs": {"lock": threading.Lock()}})
    with pytest.raises(SpecError, match=r"^model\.kwargs: a submitted job's values must be plain data"):
        prepare_submission(job)


def test_a_run_is_given_a_place_for_its_final_weights_and_settled_steps(tmp_path):
    job = prepare_run(ez.Job(name="p", train={"steps": 7}), str(tmp_path), embedded=True)
    assert job.checkpoint.uri == str(tmp_path / FINAL_CHECKPOINTS) and job.train.steps == 7
    kept = prepare_run(ez.Job(name="p", checkpoint={"uri": str(tmp_path / "mine")}), str(tmp_path), embedded=True)
    assert kept.checkpoint.uri == str(tmp_path / "mine")
