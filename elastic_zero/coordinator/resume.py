"""What `checkpoint.resume` names, read by the coordinator before it spawns a worker: a checkpoint at
or past `train.steps` leaves nothing to train, and is the job's final weights as it is (before, the
workers started, trained nothing and found no commit of the last step to call the final weights:
"the final weights could not be written"). No torch: the catalog only."""

from __future__ import annotations

import json
import os

from elastic_zero.checkpoint.catalog import list_checkpoints, open_store, read_manifest, resolve


def resume_point(uri: str, resume: str | None) -> tuple[int, str] | None:
    """(step, directory) of the checkpoint `resume` names under `uri`; None when there is none to
    resume ("latest" with nothing committed: a fresh start) or no resume is asked."""
    if not (uri and resume):
        return None
    fs, root = open_store(uri)
    if resume == "latest" and not list_checkpoints(fs, root):
        return None
    directory = resolve(fs, root, resume)
    return read_manifest(fs, directory).step, directory


def past_the_end(step: int, directory: str, steps: int) -> str:
    """The one line a job says when the checkpoint it resumes from leaves nothing to train."""
    return (f"checkpoint.resume: {directory} is at step {step}, at or past train.steps = {steps}: nothing to train; "
            f"it is the final weights")


def writable_resume_point(uri: str, resume: str | None) -> tuple[int, str] | None:
    """resume_point(), once the store at `uri` is found writable where the job runs (the CLI checked
    where it was launched): a ValueError names what is wrong."""
    from elastic_zero.checkpoint import probe_writable

    probe_writable(uri)
    return resume_point(uri, resume)


def result_of_ended_job(run_dir: str, records: list[dict], final_status: dict) -> dict:
    """The result of a job an earlier coordinator ended (it died while lingering): as its last status
    record (`final_status`), its summary.json and its event log (`records`) say."""
    path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(path)) if os.path.exists(path) else {}
    ended = next((e for e in reversed(records) if e.get("event") in ("job_finished", "job_stopped")), {})
    return {"ok": final_status["state"] != "failed", "error": final_status["error"], "summary": summary,
            "final_checkpoint": ended.get("final_checkpoint")}
