"""The user's values in a spec are sealed by the driver and opened only on the workers (job/sealed.py).
Oracles: the values themselves after a round trip; a value that records, where it is unpickled,
which actor did it: the workers, never the coordinator."""

import collections
import enum
import pickle
import subprocess
import sys
import threading

import pytest

import elastic_zero as ez
from elastic_zero.job.sealed import Sealed, opened, seal, sealed_tables
from elastic_zero.job.user_code import UserCodeError, resolve


def _double(x):
    return 2 * x


class _Config:
    def __init__(self, width):
        self.width = width


@pytest.mark.unit
def test_callables_and_objects_are_sealed_and_plain_data_is_not():
    spec = ez.Job(name="s", model={"factory": _double, "kwargs": {"width": 8, "config": _Config(4), "dims": [1, 2]}},
                  train={"loss": _double}).to_dict()
    tables = sealed_tables(spec)
    assert isinstance(tables["model"]["factory"], Sealed) and isinstance(tables["train"]["loss"], Sealed)
    kwargs = tables["model"]["kwargs"]
    assert kwargs["width"] == 8 and kwargs["dims"] == [1, 2] and isinstance(kwargs["config"], Sealed)
    assert tables["optimizer"] == spec["optimizer"] and tables["name"] == "s"
    assert repr(tables["model"]["factory"]) == "test_sealed:_double"
    assert repr(kwargs["config"]) == "a _Config (test_sealed)"
    assert sealed_tables(tables) == tables  # sealing twice seals nothing more
    # the coordinator builds its spec from the sealed tables: a sealed function passes as a function
    ez.spec.spec_from_dict(tables)


class _Act(str, enum.Enum):
    GELU = "gelu"


@pytest.mark.unit
def test_subclasses_of_plain_types_are_sealed_and_what_cannot_be_pickled_is_named():
    """A str Enum, a namedtuple or an OrderedDict would import their module where unpickled."""
    point = collections.namedtuple("Point", "x y")
    kwargs = {"act": _Act.GELU, "at": point(1, 2), "order": collections.OrderedDict(a=1), "plain": "gelu"}
    tables = sealed_tables(ez.Job(name="s", model={"factory": _double, "kwargs": kwargs}).to_dict())
    assert [k for k, v in tables["model"]["kwargs"].items() if isinstance(v, Sealed)] == ["act", "at", "order"]
    with pytest.raises(ez.SpecError, match=r"^model.kwargs.lock: cannot be sent to the workers \(TypeError: "):
        sealed_tables(ez.Job(name="s", model={"factory": _double, "kwargs": {"lock": threading.Lock()}}).to_dict())


@pytest.mark.unit
def test_a_value_that_cannot_be_pickled_ends_the_run_before_ray_starts(tmp_path):
    """In a process of its own: the suite's test processes may have a Ray up already."""
    script = ("import threading, ray, elastic_zero as ez\n"
              "start = ray.init\n"
              "ray.init = lambda *args, **kwargs: print('ray started') or start(*args, **kwargs)\n"
              "job = ez.Job(name='s', model={'preset': 'gpt-tiny', 'kwargs': {'lock': threading.Lock()}})\n"
              "try:\n"
              f"    ez.run(job, ez.RunConfig(run_dir={str(tmp_path / 'runs')!r}))\n"
              "except ez.SpecError as exc:\n"
              "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("model.kwargs.lock: cannot be sent to the workers (TypeError: "), lines
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
def test_a_sealed_value_travels_unopened_and_opens_where_it_is_used():
    sealed = pickle.loads(pickle.dumps(seal(_double)))
    assert not hasattr(sealed, "_value")  # unpickled, not loaded
    assert resolve("train.loss", sealed)(21) == 42 and sealed(4) == 8
    assert opened("model.kwargs", {"config": seal(_Config(3)), "width": 2})["config"].width == 3


@pytest.mark.unit
def test_a_sealed_value_that_cannot_be_loaded_is_one_line_naming_the_field():
    broken = Sealed(b"not a pickle", "mymodels:build")
    with pytest.raises(UserCodeError, match=r"^model.factory: cannot load mymodels:build here \(UnpicklingError: "):
        resolve("model.factory", broken)


def _unpickled_in(path):
    import ray

    with open(path, "a") as fh:  # the unpickling actor's name: the job's coordinator's, or a worker's after it
        fh.write(ray.get_runtime_context().get_actor_name() + "\n")
    return _Loud(path)


class _Loud:
    """Says, in the file it names, which actor unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _unpickled_in, (self.path,)


def _factory(tag):
    from elastic_zero.models import build_preset

    return build_preset("gpt-tiny", seed=0)


@pytest.mark.runtime
def test_the_coordinator_never_unpickles_the_users_values(tmp_path, local_ray):
    marks = tmp_path / "marks.txt"
    job = ez.Job(name="loud", model={"factory": _factory, "kwargs": {"tag": _Loud(str(marks))}},
                 train={"steps": 2, "global_batch": 4}, elastic={"workers": 2, "max_workers": 2})
    result = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "run"), progress=False))
    assert result.ok, result.error
    # each worker (named after the coordinator, "elastic-zero:loud/w<N>"), and nobody else
    assert sorted(marks.read_text().splitlines()) == ["elastic-zero:loud/w0", "elastic-zero:loud/w1"]
