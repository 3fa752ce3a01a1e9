"""One node's cloud watcher: asks the node's metadata server (AWS, GCP or Azure; which one is found
out when not given) whether the node is to be preempted, and tells the coordinator once it is.
Runs as a small Ray actor pinned to its node (metadata servers answer only the machine they run
on), with its polling on a thread of its own. Every request has a timeout and a size limit, and
a server that says something unreadable is said once, then read the safe way (see notices.py)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

from elastic_zero.preemption.notices import (
    MAX_BODY, Notice, aws_instance_action, aws_rebalance, azure_scheduled_events, gcp_preempted,
)

REQUEST_TIMEOUT_S = 2.0
PROBE_TIMEOUT_S = 0.5
AZURE_API = "api-version=2020-07-01"


def request(method: str, url: str, headers: dict | None = None, body: bytes | None = None,
         timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes, dict]:
    """(status, at most MAX_BODY + 1 bytes of the body, headers); OSError when nobody answers."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read(MAX_BODY + 1), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(MAX_BODY + 1), dict(exc.headers or {})
    except http.client.HTTPException as exc:  # not HTTP at all (a bad status line, a cut-off answer)
        raise OSError(f"not an HTTP answer: {type(exc).__name__}") from exc


class CloudWatcher:
    """The polling itself, without Ray: `tell(notice)` is called once per new notice, and
    `log(message, problem)` once per thing to say (problem False: there is simply no cloud here)."""

    def __init__(self, clouds: list[str], endpoints: dict, poll_s: float, tell, log,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.clouds, self.endpoints, self.poll_s, self.timeout_s = clouds, endpoints, poll_s, timeout_s
        self.tell, self.log = tell, log
        self._said: set[str] = set()
        self._told: set[tuple] = set()
        self._aws_token: tuple[str, float] | None = None  # (token, expires at)
        self._stop = threading.Event()
        self.cloud: str | None = None

    # ---- which cloud ------------------------------------------------------------------------

    def detect(self) -> str | None:
        """The first of `clouds` whose metadata server answers as itself, else None."""
        for cloud in self.clouds:
            try:
                if cloud == "aws" and self._aws_headers(PROBE_TIMEOUT_S):
                    return "aws"
                if cloud == "gcp":
                    status, _, headers = request("GET", f"{self.endpoints['gcp']}/computeMetadata/v1/",
                                              {"Metadata-Flavor": "Google"}, timeout_s=PROBE_TIMEOUT_S)
                    if status == 200 and headers.get("Metadata-Flavor") == "Google":
                        return "gcp"
                if cloud == "azure":
                    status, body, _ = request("GET", f"{self.endpoints['azure']}/metadata/instance?api-version=2021-02-01",
                                           {"Metadata": "true"}, timeout_s=PROBE_TIMEOUT_S)
                    if status == 200 and body.lstrip().startswith(b"{"):
                        return "azure"
            except OSError:
                continue
        return None

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        self.cloud = self.detect()
        if self.cloud is None:
            self.log(f"no metadata server of {', '.join(self.clouds)} answered: no cloud notices on this node", False)
            return
        vm_name = self._azure_vm_name() if self.cloud == "azure" else None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                for notice, problem in self._poll(vm_name):
                    if problem:
                        self._say(problem)
                    if notice is not None and (notice.source, notice.detail) not in self._told:
                        self._told.add((notice.source, notice.detail))
                        self.tell(notice)
            except OSError as exc:
                self._say(f"the {self.cloud} metadata server did not answer ({type(exc).__name__}: {exc})"[:300])
            # (GCP's request itself waits for a change, and takes longer than poll_s)
            self._stop.wait(max(0.0, self.poll_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()

    def _poll(self, vm_name: str | None) -> list[tuple[Notice | None, str | None]]:
        now = time.time()
        if self.cloud == "aws":
            headers = self._aws_headers(self.timeout_s)
            if headers is None:
                return [(None, "AWS gave no IMDSv2 session token")]
            base = f"{self.endpoints['aws']}/latest/meta-data"
            status, body, _ = request("GET", f"{base}/spot/instance-action", headers, timeout_s=self.timeout_s)
            found = [aws_instance_action(status, body, now)]
            status, body, _ = request("GET", f"{base}/events/recommendations/rebalance", headers, timeout_s=self.timeout_s)
            return found + [aws_rebalance(status, body, now)]
        if self.cloud == "gcp":  # a long poll: answers at once, then when the value changes
            wait_s = max(1, int(self.poll_s * 30))
            status, body, _ = request("GET", f"{self.endpoints['gcp']}/computeMetadata/v1/instance/preempted"
                                   f"?wait_for_change=true&timeout_sec={wait_s}", {"Metadata-Flavor": "Google"},
                                   timeout_s=wait_s + self.timeout_s)
            return [gcp_preempted(status, body, now)]
        status, body, _ = request("GET", f"{self.endpoints['azure']}/metadata/scheduledevents?{AZURE_API}",
                               {"Metadata": "true"}, timeout_s=self.timeout_s)
        return [azure_scheduled_events(status, body, now, vm_name)]

    def acknowledge(self, event_ids: tuple[str, ...]) -> None:
        """Azure: the hand-off is done, the VM may go now (StartRequests)."""
        if self.cloud != "azure" or not event_ids:
            return
        body = json.dumps({"StartRequests": [{"EventId": e} for e in event_ids]}).encode()
        try:
            status, _, _ = request("POST", f"{self.endpoints['azure']}/metadata/scheduledevents?{AZURE_API}",
                                {"Metadata": "true", "Content-Type": "application/json"}, body, self.timeout_s)
            if status != 200:
                self._say(f"Azure refused the acknowledgement of {', '.join(event_ids)}: HTTP {status}")
        except OSError as exc:
            self._say(f"Azure's acknowledgement of {', '.join(event_ids)} failed: {exc}"[:300])

    # ---- helpers --------------------------------------------------------------------------------

    def _aws_headers(self, timeout_s: float) -> dict | None:
        """IMDSv2: a session token first (PUT), kept until shortly before it expires."""
        if self._aws_token is None or time.monotonic() > self._aws_token[1]:
            status, body, _ = request("PUT", f"{self.endpoints['aws']}/latest/api/token",
                                   {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, timeout_s=timeout_s)
            if status != 200 or not body or len(body) > 1024:
                return None
            self._aws_token = (body.decode("ascii", "replace").strip(), time.monotonic() + 21000)
        return {"X-aws-ec2-metadata-token": self._aws_token[0]}

    def _azure_vm_name(self) -> str | None:
        try:
            status, body, _ = request("GET", f"{self.endpoints['azure']}/metadata/instance/compute/name"
                                   "?api-version=2021-02-01&format=text", {"Metadata": "true"}, timeout_s=self.timeout_s)
            return body.decode().strip() or None if status == 200 and len(body) <= 256 else None
        except (OSError, UnicodeDecodeError):
            return None

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self.log(message, True)
