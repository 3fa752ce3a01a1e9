"""Experiment tracking ([tracking], observe/tracking*.py). Pure parts: which metrics the job's events
make, the spec as parameters, a failing tracker told once and dropped (training never waits on it),
the one-line refusals. Against the real libraries (skipped where an extra is not installed): a job's
MLflow run read back with MlflowClient, its TensorBoard scalars with EventAccumulator, and a relaunch
that resumes its checkpoints continuing the same MLflow run."""

import importlib.util
import threading

import pytest

from elastic_zero.job.spec import SpecError, spec_from_dict
from elastic_zero.observe.tracking import (FAILURES_TO_DROP, Tracking, missing_extra, points_of_change,
                                           points_of_event, spec_params)

has_mlflow = importlib.util.find_spec("mlflow") is not None
has_tensorboard = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.unit
def test_the_events_and_the_measured_changes_become_metrics():
    assert points_of_event({"event": "eval", "step": 10, "loss": 2.0, "perplexity": 7.39, "metrics": {"acc": 0.5}}) \
        == [("eval/loss", 2.0, 10), ("eval/perplexity", 7.39, 10), ("eval/acc", 0.5, 10)]
    start = {"event": "generation_start", "step": 7, "source": "snapshot", "workers": ["w0", "w1"]}
    assert points_of_event(start) == [("job/world_size", 2, 7)]
    # a checkpoint restore's step is known later (-1), and other events make no metric
    assert points_of_event({"event": "generation_start", "step": -1, "source": "checkpoint"}) == []
    assert points_of_event({"event": "worker_lost", "actor_id": "w1"}) == []
    # recoveries (from memory or from a checkpoint alike) and reconfigurations, as the books measured them
    assert points_of_change({"step": 40, "stall_s": 1.5}, "recoveries", 2) == [("job/recoveries", 2, 40),
                                                                               ("job/stall_s", 1.5, 40)]
    assert points_of_change({"step": None}, "recoveries", 1) == []
    good = _Backend("good")
    tracking = Tracking([good], lambda text: None)
    tracking.change({"step": 5, "stall_s": 0.2}, "reconfigurations")
    tracking.change({"step": 9, "stall_s": 0.3}, "recoveries")
    tracking.change({"step": 12, "stall_s": 0.4}, "reconfigurations")
    tracking.finish("summary.json", None, True)
    assert [p for call in good.calls if call[0] == "metrics" for p in call[1] if p[0] != "job/stall_s"] == [
        ("job/reconfigurations", 1, 5), ("job/recoveries", 1, 9), ("job/reconfigurations", 2, 12)]


@pytest.mark.unit
def test_the_spec_becomes_flat_parameters():
    params = spec_params(spec_from_dict({"name": "p", "train": {"steps": 7}, "faults": [
        {"at_step": 2, "action": "kill", "rank": 1}]}).to_dict())
    assert params["name"] == "p" and params["train.steps"] == "7" and params["optimizer.betas"] == "[0.9, 0.95]"
    assert '"action": "kill"' in params["faults"] and "model.factory" not in params  # absent: left out


class _Backend:
    def __init__(self, name, fail_on=None):
        self.name, self.fail_on, self.calls = name, fail_on, []

    def abandon(self):
        self.calls.append("abandon")

    def start(self):
        self.calls.append("start")

    def metrics(self, points):
        if self.fail_on == "metrics":
            raise ConnectionError("tracking server unreachable\nsecond line")
        self.calls.append(("metrics", points))

    def finish(self, summary_path, plot_path, ok):
        self.calls.append(("finish", ok))


@pytest.mark.unit
def test_a_failing_tracker_is_one_warning_and_the_others_go_on():
    warnings = []
    good, bad = _Backend("good"), _Backend("bad", fail_on="metrics")
    tracking = Tracking([good, bad], warnings.append)
    tracking.train_points([(0, 3.0), (1, 2.5)], 40.0)
    tracking.event({"event": "eval", "step": 1, "loss": 2.7, "metrics": {}})
    assert tracking.flush() and warnings == []  # a failure or two may be a blip: tried again
    for step in range(2, 2 + FAILURES_TO_DROP):
        tracking.train_points([(step, 2.0)], None)
    tracking.event({"event": "not even an event"})  # nothing for the trackers, and never an error
    tracking.finish("summary.json", None, True)
    assert warnings == ["tracking: bad failed and is off for the rest of the job: ConnectionError: "
                        "tracking server unreachable"]
    assert good.calls[:3] == ["start", ("metrics", [("train/loss", 3.0, 0), ("train/loss", 2.5, 1),
                                                    ("train/samples_per_s", 40.0, 1)]),
                              ("metrics", [("eval/loss", 2.7, 1)])]
    assert good.calls[-1] == ("finish", True)
    assert bad.calls == ["start", "abandon"]  # dropped at its third failure in a row, its run marked failed


@pytest.mark.unit
def test_a_tracker_that_hangs_never_holds_the_caller():
    release = threading.Event()

    class Hanging(_Backend):
        def start(self):
            release.wait(30)

    tracking = Tracking([Hanging("hang")], lambda text: None)
    for step in range(1000):  # queued, not waited on
        tracking.train_points([(step, 1.0)], None)
    release.set()
    tracking.finish("summary.json", None, True)


@pytest.mark.unit
@pytest.mark.parametrize("section, message", [
    ({"backends": ["wandb"]}, "tracking.backends[0]: got 'wandb'; allowed: 'mlflow', 'tensorboard'"),
    ({"backends": ["mlflow", "mlflow"]}, "tracking.backends: names a backend twice"),
    ({"backends": "mlflow"}, "tracking.backends: must be a list"),
    ({"mlflow_uri": ""}, "tracking.mlflow_uri: must not be empty"),
])
def test_a_wrong_tracking_section_is_one_line(section, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        spec_from_dict({"tracking": section})


@pytest.mark.unit
def test_a_tracking_extra_not_installed_is_named_before_ray_starts(monkeypatch):
    from elastic_zero.job.preflight import preflight
    from elastic_zero.observe import tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(SpecError, match=r"^tracking\.backends: 'mlflow' needs mlflow, which is not installed: "
                                        r"pip install 'elastic-zero\[mlflow\]'$"):
        preflight(spec_from_dict({"tracking": {"backends": ["mlflow"]}}))
    assert missing_extra("tensorboard") is None or not has_tensorboard


@pytest.mark.unit
def test_the_steps_no_note_told_are_told_at_the_generation_end():
    good = _Backend("good")
    tracking = Tracking([good], lambda text: None)
    tracking.train_points([(0, 3.0)], None)
    tracking.generation_losses({0: 3.0, 1: 2.9, 2: 2.8})  # the generation failed before its next note
    tracking.finish("summary.json", None, True)
    assert [p for call in good.calls if call[0] == "metrics" for p in call[1]] == [
        ("train/loss", 3.0, 0), ("train/loss", 2.9, 1), ("train/loss", 2.8, 2)]


@pytest.mark.runtime
@pytest.mark.skipif(not (has_mlflow and has_tensorboard), reason="pip install -e '.[mlflow,tensorboard]'")
@pytest.mark.usefixtures("local_ray")
def test_a_job_is_tracked_in_mlflow_and_tensorboard_and_its_relaunch_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's own client, as the coordinator does
    from mlflow.tracking import MlflowClient
    from runtime_jobs import job
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri, tb = str(tmp_path / "mlruns"), str(tmp_path / "tb")
    sections = dict(tracking={"backends": ["mlflow", "tensorboard"], "mlflow_uri": uri, "experiment": "exp",
                              "tensorboard_dir": tb},
                    checkpoint={"uri": str(tmp_path / "ck"), "every": 4, "resume": "latest"},
                    eval={"source": "synthetic", "batches": 1, "every": 4})
    code, summary, _, _ = job(tmp_path, "first", [{"at_step": 6, "action": "kill", "rank": 1}],
                              train={"steps": 12}, **sections)
    assert code == 0, summary.get("error")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("exp").experiment_id
    (run,) = client.search_runs([experiment])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "12"
    assert run.data.params["tracking.backends"] == '["mlflow", "tensorboard"]'
    # every step's loss, the evaluations, the kill's recovery and its stall
    assert {m.step for m in client.get_metric_history(run_id, "train/loss")} == set(range(12))
    assert [m.step for m in client.get_metric_history(run_id, "eval/loss")] == [0, 4, 8, 12]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "job/recoveries")] == [(6, 1.0)]
    assert client.get_metric_history(run_id, "job/stall_s")[0].value > 0
    assert {a.path for a in client.list_artifacts(run_id)} >= {"summary.json", "run.png"}
    scalars = EventAccumulator(tb)
    scalars.Reload()
    assert [e.step for e in scalars.Scalars("eval/loss")] == [0, 4, 8, 12]
    assert {e.step for e in scalars.Scalars("train/loss")} == set(range(12))
    # relaunched with more steps: it resumes the checkpoints, and the same MLflow run goes on
    code, summary, _, _ = job(tmp_path, "second", train={"steps": 20}, **sections)
    assert code == 0 and summary["resumed_from_step"] == 12, summary.get("error")
    (again,) = client.search_runs([experiment])
    assert again.info.run_id == run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "eval/loss")][-2:] == [16, 20]


@pytest.mark.runtime
@pytest.mark.skipif(not has_mlflow, reason="pip install -e '.[mlflow]'")
@pytest.mark.usefixtures("local_ray")
def test_a_tracking_server_that_does_not_answer_is_a_warning_and_the_job_trains_on(tmp_path):
    from runtime_jobs import job

    code, summary, events, _ = job(tmp_path, "untracked", train={"steps": 6}, elastic={"workers": 1},
                                   tracking={"backends": ["mlflow"], "mlflow_uri": "http://127.0.0.1:9"})
    assert code == 0 and summary["steps"] == 6, summary.get("error")
    (warning,) = [w for w in summary["warnings"] if w.startswith("tracking:")]
    assert warning.startswith("tracking: mlflow failed and is off for the rest of the job: ")
    assert [e["message"] for e in events if e["event"] == "warning"] == [warning]
