"""A running job's status record as its coordinator last published it (coordinator/status_file.py),
read over the dashboard's HTTP address alone: Ray's state API names the node of the live coordinator
(`/api/v0/actors`), and Ray's log API reads the file there (`/api/v0/logs/file`). Two requests of about
10 ms each on a 2-core machine, where a control job takes 3-3.7 s.

The record is used only when it is the live coordinator's own and recent: a coordinator that is
starting, restarting or gone, a file it has not written yet, or one older than STALE_S, is answered by
asking the coordinator itself (a control job), which also knows the final record of a job that is over.
"""

from __future__ import annotations

import json
import time
import urllib.parse

from elastic_zero.observe.live import STATUS_KEYS, status_file_name

STALE_S = 30.0  # a record older than this (its coordinator's clock against this one's) is not used
REQUEST_TIMEOUT_S = 10.0


def live_coordinator(rows: list[dict], namespace: str) -> dict | None:
    """The one live actor among the state API's `rows` of the coordinator's name, None if not exactly one."""
    alive = [r for r in rows if r.get("state") == "ALIVE" and r.get("ray_namespace") == namespace]
    return alive[0] if len(alive) == 1 else None


def usable_record(text: str, job_id: str, coordinator_pid: int, now: float) -> dict | None:
    """The record in a status file's `text`, if it is whole, of job `job_id`, written by the coordinator
    whose process is `coordinator_pid` (not an earlier one's on the same node) and at most STALE_S old."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or list(record) != list(STATUS_KEYS) or record["job_id"] != job_id:
        return None
    if (record["coordinator"] or {}).get("pid") != coordinator_pid:
        return None
    if not isinstance(record["as_of"], (int, float)) or now - record["as_of"] > STALE_S:
        return None
    return record


def read_published(jobs, job_id: str, coordinator_name: str, namespace: str) -> dict | None:
    """The live coordinator's published record of `job_id` through `jobs` (a JobSubmissionClient: its
    address, token and TLS settings; `_do_request` is its one way to reach the dashboard's other APIs),
    None where there is none to use. Any failure is None: the caller asks the coordinator instead, and
    that path says what is wrong in one line."""
    try:
        query = urllib.parse.urlencode({"filter_keys": "name", "filter_predicates": "=",
                                        "filter_values": coordinator_name, "limit": 100})
        answer = jobs._do_request("GET", f"/api/v0/actors?{query}", timeout=REQUEST_TIMEOUT_S)
        if answer.status_code != 200:
            return None
        actor = live_coordinator(answer.json()["data"]["result"]["result"], namespace)
        if actor is None:
            return None
        query = urllib.parse.urlencode({"node_id": actor["node_id"], "filename": status_file_name(job_id),
                                        "lines": -1})
        answer = jobs._do_request("GET", f"/api/v0/logs/file?{query}", timeout=REQUEST_TIMEOUT_S)
        if answer.status_code != 200:
            return None
        return usable_record(answer.content.decode("utf-8", errors="replace"), job_id, actor["pid"], time.time())
    except Exception:  # noqa: BLE001 - the network, the token, a dashboard without these APIs
        return None
