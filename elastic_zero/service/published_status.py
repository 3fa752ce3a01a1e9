"""A running job's status record as its coordinator last published it (coordinator/status_file.py),
read over the dashboard's HTTP address alone: Ray's state API names the node of the live coordinator
(`/api/v0/actors`), and Ray's log API reads the file there (`/api/v0/logs/file`). Two requests of about
10 ms each on a 2-core machine, where a control job takes 3-3.7 s.

The record is used only when it is the live coordinator's own and recent: a coordinator that is
starting, restarting or gone, a file it has not written yet, or a record older than STALE_S by the
dashboard's clock, is answered by asking the coordinator itself (a control job), which also knows the
final record of a job that is over.
"""

from __future__ import annotations

import email.utils
import json
import time
import urllib.parse

from elastic_zero.coordinator.status_file import LONGEST_PERIOD_S
from elastic_zero.observe.live import STATUS_KEYS, status_file_name

STALE_S = 3 * LONGEST_PERIOD_S  # a record older than three of its publisher's longest periods is not used
FUTURE_SLACK_S = 2.0  # a record this far ahead of the dashboard's clock is still taken (its Date has whole seconds)
BUDGET_S = 3.0  # both requests together, before the control job is asked instead
SERVER_TIMEOUT_S = 2  # what the dashboard may spend on each (whole seconds, its parameter)


def live_coordinator(rows: list[dict], namespace: str) -> dict | None:
    """The one live actor among the state API's `rows` of the coordinator's name, None if not exactly one."""
    alive = [r for r in rows if r.get("state") == "ALIVE" and r.get("ray_namespace") == namespace]
    return alive[0] if len(alive) == 1 else None


def usable_record(text: str, job_id: str, coordinator_pid: int, now: float) -> dict | None:
    """The record in a status file's `text`, if it is whole, of job `job_id`, written by the coordinator
    whose process is `coordinator_pid` (not an earlier one's on the same node), and made at most STALE_S
    before `now` (the dashboard's clock, on the head, where the coordinator runs) and not after it."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or list(record) != list(STATUS_KEYS) or record["job_id"] != job_id:
        return None
    if (record["coordinator"] or {}).get("pid") != coordinator_pid:
        return None
    made = record["as_of"]
    if not isinstance(made, (int, float)) or not -FUTURE_SLACK_S <= now - made <= STALE_S:
        return None
    return record


def actors_query(coordinator_name: str, ray_job_id: str | None) -> str:
    """The state API's query for the live actors of the coordinator's name: the state and the Ray job
    (the submission's driver made every coordinator of the job) are filtered by Ray's GCS itself, so
    the answer does not grow with the cluster's other actors, dead ones included; the name after."""
    filters = [("state", "ALIVE"), *([("job_id", ray_job_id)] if ray_job_id else []), ("name", coordinator_name)]
    return urllib.parse.urlencode({"filter_keys": [k for k, _ in filters], "filter_predicates": ["="] * len(filters),
                                   "filter_values": [v for _, v in filters], "limit": 100,
                                   "timeout": SERVER_TIMEOUT_S}, doseq=True)


def dashboard_time(answer) -> float:
    """The dashboard's clock, from its answer's Date header; this machine's where it has none."""
    try:
        return email.utils.parsedate_to_datetime(answer.headers["Date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return time.time()


def read_published(jobs, job_id: str, coordinator_name: str, namespace: str, ray_job_id: str | None = None) -> dict | None:
    """The live coordinator's published record of `job_id` through `jobs` (a JobSubmissionClient: its
    address, token and TLS settings; `_do_request` is its one way to reach the dashboard's other APIs),
    None where there is none to use. Any failure is None: the caller asks the coordinator instead, and
    that path says what is wrong in one line. Both requests together take at most BUDGET_S."""
    deadline = time.monotonic() + BUDGET_S

    def get(path: str):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {BUDGET_S:g} s")
        return jobs._do_request("GET", path, timeout=left)

    try:
        answer = get(f"/api/v0/actors?{actors_query(coordinator_name, ray_job_id)}")
        if answer.status_code != 200:
            return None
        actor = live_coordinator(answer.json()["data"]["result"]["result"], namespace)
        if actor is None:
            return None
        query = urllib.parse.urlencode({"node_id": actor["node_id"], "filename": status_file_name(job_id),
                                        "lines": -1, "timeout": SERVER_TIMEOUT_S})
        answer = get(f"/api/v0/logs/file?{query}")
        if answer.status_code != 200:
            return None
        return usable_record(answer.content.decode("utf-8", errors="replace"), job_id, actor["pid"],
                             dashboard_time(answer))
    except Exception:  # noqa: BLE001 - the network, the token, a dashboard without these APIs
        return None
