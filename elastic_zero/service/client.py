"""`Client`: jobs on a Ray cluster from Python, as the CLI does them.

    client = elastic_zero.Client("http://HEAD:8265")
    job_id = client.submit(job)            # returns at once; the job runs on the cluster
    client.status(job_id)                  # the status record (docs/service.md)
    client.scale(job_id, 4); client.stop(job_id, checkpoint=True)
    for chunk in client.logs(job_id, follow=True): print(chunk, end="")
    client.wait(job_id)                    # the last status, once the job is over

`address` is the cluster's Jobs API (its dashboard, http://HEAD:8265; default RAY_ADDRESS or
RAY_API_SERVER_ADDRESS, else http://127.0.0.1:8265). Submitting, listing, logs and the Ray job's
state go over HTTP, and so does status while the job's coordinator lives (the record it publishes each
second, through Ray's log API); scale and stop, and status otherwise, reach the coordinator through a
short control job on the cluster (so the Jobs API address is all a client needs). An address that is not http(s)
("auto", "HOST:6379") instead connects this process to the cluster and calls the coordinator directly.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Iterator

from elastic_zero.observe.live import status_record
from elastic_zero.service import control
from elastic_zero.service.auth import explain, use_cluster_token
from elastic_zero.service.published_status import read_published
from elastic_zero.service.submission import (
    CONTROL_KIND, JOB_KIND, control_entrypoint, job_entrypoint, job_runtime_env, new_job_id, read_control_answer,
)
from elastic_zero.job.prepare import prepare_submission
from elastic_zero.job.sections import scale_refusal
from elastic_zero.job.spec import JobSpec, SpecError

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")  # the Ray job's
OVER = ("finished", "stopped", "failed")  # the elastic-zero job's
CONTROL_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """The cluster cannot be reached, refused the request, or has no such job: one line."""


class Client:
    def __init__(self, address: str | None = None) -> None:
        address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") \
            or "http://127.0.0.1:8265"
        self.address = address
        self.http = address.startswith(("http://", "https://"))
        use_cluster_token()
        self._jobs = None
        if self.http:
            from ray.job_submission import JobSubmissionClient

            self._jobs = self._guard(lambda: JobSubmissionClient(address))

    # ---- submission and the Ray job ----------------------------------------------------------------

    def submit(self, job: JobSpec, *, working_dir: str | None = ".", run_dir: str | None = None,
               job_id: str | None = None, excludes=()) -> str:
        """Validate `job` here (SpecError naming the field), submit it, return its id at once.
        `working_dir` goes to the cluster (the user's modules named in the spec are found there);
        `run_dir` is a path on the cluster (default ~/elastic-zero/runs/JOB_ID)."""
        self._need_http("submit")
        spec = prepare_submission(job)
        job_id = job_id or new_job_id(job.name)
        if working_dir is not None and not os.path.isdir(working_dir):
            raise SpecError(f"working dir {working_dir!r} is not a directory")
        runtime_env = job_runtime_env(spec, os.path.abspath(working_dir) if working_dir else None, excludes)
        return self._guard(lambda: self._jobs.submit_job(
            entrypoint=job_entrypoint(job_id, run_dir), submission_id=job_id, runtime_env=runtime_env,
            metadata={"elastic_zero": JOB_KIND, "name": job.name}, entrypoint_num_cpus=0))

    def list(self) -> list[dict]:
        """The elastic-zero jobs the cluster knows, oldest first."""
        self._need_http("list")
        rows = []
        for info in self._guard(self._jobs.list_jobs):
            meta = info.metadata or {}
            if meta.get("elastic_zero") != JOB_KIND:
                continue
            rows.append({"job_id": info.submission_id, "name": meta.get("name"), "ray_job_status": str(info.status.value),
                         "start_time": info.start_time, "end_time": info.end_time, "message": info.message})
        return sorted(rows, key=lambda r: r["start_time"] or 0)

    def logs(self, job_id: str, follow: bool = False) -> Iterator[str]:
        """The job's driver output (the progress and event lines); with `follow`, until it ends."""
        self._need_http("logs")
        self._info(job_id)
        if not follow:
            yield self._guard(lambda: self._jobs.get_job_logs(job_id))
            return
        agen = self._jobs.tail_job_logs(job_id)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    chunk = loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
                except Exception as exc:  # noqa: BLE001 - the network or the token, mid-stream: one line
                    raise ClusterError(explain(exc, self.address)) from None
                yield chunk
        finally:
            loop.close()

    # ---- the running job, through its coordinator ---------------------------------------------------

    def status(self, job_id: str, live: bool = False) -> dict:
        """The status record; for a job whose coordinator is gone (over), what the Ray job says. Over
        the dashboard's address, a live coordinator's record as it last published it (about once a
        second: `as_of`), unless `live`; else its answer now, through a control job."""
        info = self._info(job_id) if self.http else None
        record = self._published(job_id, info) if self.http and not live else None
        if record is not None:
            record["ray_job_status"] = str(info.status.value)
            return record
        answer = self._control("status", job_id)
        if answer["ok"]:
            record = answer["value"]
        elif answer.get("missing") and info is None:  # a direct connection: nothing else to ask
            raise ClusterError(answer["error"])
        elif answer.get("missing"):
            record = status_record(job_id=job_id, name=(info.metadata or {}).get("name") if info else None,
                                   state=_ray_state(info), error=info.message if info and info.status.value == "FAILED" else None)
        else:
            raise ClusterError(answer["error"])
        record["ray_job_status"] = str(info.status.value) if info else None
        return record

    def published_status(self, job_id: str) -> dict | None:
        """The record the job's live coordinator last published (service/published_status.py), read
        over HTTP in milliseconds; None where there is none to use (no live coordinator, none written
        yet, or older than 30 s by the dashboard's clock): then status() asks the coordinator itself.
        Its `ray_job_status` is null (the coordinator does not know it); status() fills it in."""
        self._need_http("published_status")
        return self._published(job_id, self._info(job_id))

    def _published(self, job_id: str, info) -> dict | None:
        from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name

        return read_published(self._jobs, job_id, coordinator_name(job_id), NAMESPACE, info.job_id)

    def scale(self, job_id: str, workers: int) -> str:
        """Outside the job's [min_workers, max_workers] it is refused here, in milliseconds, where the
        job's published status says so (over the dashboard's address); else the coordinator decides."""
        workers = int(workers)
        if self.http:
            record = self._published(job_id, self._info(job_id))
            refusal = record and scale_refusal(workers, record["min_workers"], record["max_workers"])
            if refusal:
                raise ClusterError(refusal)
        return self._answer("scale", job_id, workers=workers)

    def stop(self, job_id: str, checkpoint: bool = False) -> str:
        """Graceful: the job ends at its next safe point (after a final checkpoint if asked) and exits 0."""
        return self._ask("stop", job_id, checkpoint=bool(checkpoint))

    def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 2.0) -> dict:
        """Wait until the job is over (finished, stopped or failed); returns its last status record.
        While the Ray job runs, its driver is alive and the job is not over; once the Ray job ended,
        the coordinator may still train (its driver died): then its own state decides."""
        self._need_http("wait")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if str(self._info(job_id).status.value) in TERMINAL:
                record = self.status(job_id)
                if record["state"] in OVER:
                    return record
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still running after {timeout_s:.0f} s")
            time.sleep(poll_s)

    # ---- plumbing -----------------------------------------------------------------------------------

    def _ask(self, op: str, job_id: str, **args) -> str:
        if self.http:
            self._info(job_id)
        return self._answer(op, job_id, **args)

    def _answer(self, op: str, job_id: str, **args) -> str:
        """The coordinator's answer to `op`, through a control job (or directly); its refusal raised."""
        answer = self._control(op, job_id, **args)
        if not answer["ok"]:
            raise ClusterError(answer["error"])
        return answer["value"]

    def _control(self, op: str, job_id: str, **args) -> dict:
        if not self.http:
            try:
                return {"ok": True, "value": control.call(op, job_id, self.address, **args)}
            except control.NoSuchJob as exc:
                return {"ok": False, "error": str(exc), "missing": True}
            except ValueError as exc:
                return {"ok": False, "error": str(exc)}
            except Exception as exc:  # noqa: BLE001 - no cluster there, a token refused, the coordinator gone
                raise ClusterError(explain(exc, self.address)) from None
        control_id = self._guard(lambda: self._jobs.submit_job(
            entrypoint=control_entrypoint(op, job_id, **args), metadata={"elastic_zero": CONTROL_KIND, "job": job_id},
            entrypoint_num_cpus=0))
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while str(self._guard(lambda: self._jobs.get_job_status(control_id)).value) not in TERMINAL:
            if time.monotonic() > deadline:
                raise ClusterError(f"{op} {job_id}: no answer from the cluster within {CONTROL_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        logs = self._guard(lambda: self._jobs.get_job_logs(control_id))
        self._guard(lambda: self._jobs.delete_job(control_id))
        answer = read_control_answer(logs)
        if answer is None:
            tail = [line for line in logs.strip().splitlines() if line.strip()]
            raise ClusterError(f"{op} {job_id}: the control job failed: {tail[-1] if tail else 'no output'}")
        return answer

    def _info(self, job_id: str):
        try:
            info = self._jobs.get_job_info(job_id)
        except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError for an unknown id, others for the network
            if "does not exist" in str(exc) or "404" in str(exc):
                raise ClusterError(f"no job {job_id!r} on the Ray cluster at {self.address}") from None
            raise ClusterError(explain(exc, self.address)) from None
        if (info.metadata or {}).get("elastic_zero") != JOB_KIND:
            raise ClusterError(f"job {job_id!r} on the Ray cluster at {self.address} is not an elastic-zero job")
        return info

    def _guard(self, fn):
        try:
            return fn()
        except (SpecError, ClusterError):
            raise
        except Exception as exc:  # noqa: BLE001 - the network, the token, Ray's refusals: one line
            raise ClusterError(explain(exc, self.address)) from None

    def _need_http(self, what: str) -> None:
        if not self.http:
            raise ClusterError(f"{what} needs the cluster's Jobs API address (http://HEAD:8265), not {self.address!r}")


def _ray_state(info) -> str:
    if info is None:
        return "unknown"
    return {"SUCCEEDED": "finished", "FAILED": "failed", "STOPPED": "stopped", "PENDING": "starting",
            "RUNNING": "starting"}.get(str(info.status.value), str(info.status.value).lower())
