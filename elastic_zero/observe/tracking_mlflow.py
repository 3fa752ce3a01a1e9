"""The MLflow tracker (observe/tracking.py): one MLflow run per job, through `MlflowClient` (no global
active run in the coordinator's process).

A job that goes on continues its run rather than opening another: a restarted coordinator finds the
run's id in RUN_DIR/tracking.json; a relaunch with `checkpoint.resume` finds the newest run of the
experiment tagged with the same checkpoint store.
"""

from __future__ import annotations

import json
import os
import time

RESUME_TAG = "elastic_zero.checkpoint_uri"


class MlflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, job_id: str, run_dir: str, params: dict,
                 checkpoint_uri: str | None, resume: bool, restarted: bool) -> None:
        self.uri, self.experiment, self.job_id, self.run_dir = uri, experiment, job_id, run_dir
        self.params, self.checkpoint_uri, self.resume, self.restarted = params, checkpoint_uri, resume, restarted
        self.client = self.run_id = None

    def start(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # a server that does not answer fails the tracker in seconds, not after MLflow's minutes of
        # retries (its own settings win where given)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if "://" not in self.uri or self.uri.startswith("file:"):
            # a file store, the default (./mlruns): MLflow 3 keeps it in maintenance mode and refuses it
            # unless asked; a team's server or database URI needs nothing
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
        self.run_id = self._run_to_continue(experiment_id)
        if self.run_id is None:
            tags = {"elastic_zero.job_id": self.job_id, "elastic_zero.run_dir": self.run_dir}
            if self.checkpoint_uri:
                tags[RESUME_TAG] = self.checkpoint_uri
            self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=self.job_id).info.run_id
            params = [Param(k, v) for k, v in sorted(self.params.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        with open(os.path.join(self.run_dir, "tracking.json"), "w") as fh:
            json.dump({"mlflow_run_id": self.run_id, "mlflow_uri": self.uri}, fh)

    def _run_to_continue(self, experiment_id: str) -> str | None:
        path = os.path.join(self.run_dir, "tracking.json")
        if self.restarted and os.path.exists(path):  # the same job, its coordinator restarted (a run
            # directory used again by another job starts a run of its own)
            with open(path) as fh:
                run_id = json.load(fh).get("mlflow_run_id")
            if run_id:
                return run_id
        if self.resume and self.checkpoint_uri:  # a relaunch that resumes the same checkpoints
            found = self.client.search_runs(
                [experiment_id], filter_string=f"tags.`{RESUME_TAG}` = '{self.checkpoint_uri}'",
                order_by=["attributes.start_time DESC"], max_results=1)
            if found:
                return found[0].info.run_id
        return None

    def metrics(self, points: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, int(step)) for key, value, step in points]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def abandon(self) -> None:
        """Dropped after failing: the run is marked failed, if MLflow can still be told."""
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")

    def finish(self, summary_path: str, plot_path: str | None, ok: bool) -> None:
        for path in (summary_path, plot_path):
            if path and os.path.exists(path):
                self.client.log_artifact(self.run_id, path)
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
