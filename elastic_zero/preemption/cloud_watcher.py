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
import urllib.parse
import urllib.request

from elastic_zero.preemption.notices import (
    MAX_BODY, Notice, aws_instance_action, aws_rebalance, azure_scheduled_events, gcp_preempted,
)

REQUEST_TIMEOUT_S = 2.0
# never through $http_proxy: a metadata server answers only the machine it runs on
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PROBE_TIMEOUT_S = 0.5
AZURE_API = "api-version=2020-07-01"


def request(method: str, url: str, headers: dict | None = None, body: bytes | None = None,
         timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes, dict]:
    """(status, at most MAX_BODY + 1 bytes of the body, headers by lower-case name); OSError when
    nobody answers."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _DIRECT.open(req, timeout=timeout_s) as reply:
            return reply.status, reply.read(MAX_BODY + 1), {k.lower(): v for k, v in reply.headers.items()}
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read(MAX_BODY + 1), {k.lower(): v for k, v in (exc.headers or {}).items()}
        except http.client.HTTPException as cut:
            raise OSError(f"a cut-off answer: {type(cut).__name__}") from cut
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
        self._gcp_etag: str | None = None  # the preempted value's version last seen
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
                    if status == 200 and headers.get("metadata-flavor") == "Google":
                        return "gcp"
                if cloud == "azure":
                    status, body, _ = request("GET", f"{self.endpoints['azure']}/metadata/instance?api-version=2021-02-01",
                                           {"Metadata": "true"}, timeout_s=PROBE_TIMEOUT_S)
                    if status == 200 and body.lstrip().startswith(b"{"):
                        return "azure"
            except Exception:  # noqa: BLE001 - not this cloud (nobody there, or something else answering)
                continue
        return None

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        self.cloud = self.detect()
        if self.cloud is None:
            self._say(f"no metadata server of {', '.join(self.clouds)} answered: no cloud notices on this node", False)
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
            except Exception as exc:  # noqa: BLE001 - whatever an answer does, the watch goes on
                self._say(f"reading the {self.cloud} metadata failed ({type(exc).__name__}: {exc})"[:300])
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
            if status == 401:  # the session token expired or was revoked: a new one at the next poll
                self._aws_token = None
                return [(None, None)]
            found = [aws_instance_action(status, body, now)]
            status, body, _ = request("GET", f"{base}/events/recommendations/rebalance", headers, timeout_s=self.timeout_s)
            return found + [aws_rebalance(status, body, now)]
        if self.cloud == "gcp":
            # the value now, then a long poll that answers when it differs from what was seen
            # (last_etag); a server that gives no ETag is asked every poll_s instead
            url = f"{self.endpoints['gcp']}/computeMetadata/v1/instance/preempted"
            wait_s = max(1, int(self.poll_s * 30))
            etag, self._gcp_etag = self._gcp_etag, None  # kept only after an answer
            if etag:
                url += f"?wait_for_change=true&last_etag={urllib.parse.quote(etag[:200], safe='')}&timeout_sec={wait_s}"
            status, body, headers = request("GET", url, {"Metadata-Flavor": "Google"}, timeout_s=wait_s + self.timeout_s)
            self._gcp_etag = headers.get("etag") if status == 200 else None
            return [gcp_preempted(status, body, time.time())]
        status, body, _ = request("GET", f"{self.endpoints['azure']}/metadata/scheduledevents?{AZURE_API}",
                               {"Metadata": "true"}, timeout_s=self.timeout_s)
        return [azure_scheduled_events(status, body, now, vm_name)]

    def acknowledge(self, event_ids: tuple[str, ...]) -> bool | str:
        """Azure: the hand-off is done, the VM may go now (StartRequests). True, or why not. Sent
        whether or not this watcher has found out its cloud yet (it may have just taken over)."""
        if "azure" not in self.clouds or not event_ids:
            return "this node does not watch Azure"
        body = json.dumps({"StartRequests": [{"EventId": e} for e in event_ids]}).encode()
        try:
            status, _, _ = request("POST", f"{self.endpoints['azure']}/metadata/scheduledevents?{AZURE_API}",
                                   {"Metadata": "true", "Content-Type": "application/json"}, body, self.timeout_s)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
        return True if status == 200 else f"HTTP {status}"

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

    def _say(self, message: str, problem: bool = True) -> None:
        if message not in self._said:
            self._said.add(message)
            try:
                self.log(message, problem)
            except Exception:  # noqa: BLE001 - nobody to tell (the coordinator restarting): the watch goes on
                pass
