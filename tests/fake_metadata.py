"""A cloud's metadata server on loopback, for the preemption watchers' tests: real HTTP, the paths,
headers and answers of AWS IMDSv2, GCP and Azure Scheduled Events, and the bad answers a watcher
must survive (set `answer` to bytes to say those, `hang_s` to say nothing for a while). Several
nodes on one machine share it; for AWS each watcher gets its own session token, and a notice may
be meant for one token's holder only (`only_token`): one node's instance action."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class FakeMetadata:
    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.notice: dict | None = None  # aws: {"action", "time"}; azure: a list of events; gcp: True
        self.rebalance: dict | None = None
        self.answer: bytes | None = None  # said instead of the notice (a bad answer)
        self.hang_s = 0.0
        self.acks: list = []
        self.tokens: list[str] = []  # AWS session tokens given, one per PUT: one per watcher (node)
        self.only_token: str | None = None  # AWS: the notice is for the holder of this token only
        self.requests: list[tuple[str, str, dict]] = []
        self.changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                fake.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if fake.cloud == "aws" and self.path == "/latest/api/token" and \
                        self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.tokens.append(f"token-{len(fake.tokens) + 1}")
                    return self._reply(200, fake.tokens[-1].encode())
                self._reply(404, b"")

            def do_POST(self):
                fake.requests.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if fake.cloud == "azure" and self.path.startswith("/metadata/scheduledevents") and \
                        self.headers.get("Metadata") == "true":
                    fake.acks.append(json.loads(body))
                    return self._reply(200, b"")
                self._reply(400, b"")

            def do_GET(self):
                fake.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                url = urlparse(self.path)
                if fake.hang_s:
                    time.sleep(fake.hang_s)
                if fake.cloud == "aws":
                    token = self.headers.get("X-aws-ec2-metadata-token")
                    if token not in fake.tokens:
                        return self._reply(401, b"")
                    if url.path == "/latest/meta-data/spot/instance-action":
                        if fake.answer is not None:
                            return self._reply(200, fake.answer)
                        ours = fake.only_token is None or token == fake.only_token
                        return self._reply(200, json.dumps(fake.notice).encode()) if fake.notice and ours \
                            else self._reply(404, b"")
                    if url.path == "/latest/meta-data/events/recommendations/rebalance":
                        return self._reply(200, json.dumps(fake.rebalance).encode()) if fake.rebalance else self._reply(404, b"")
                if fake.cloud == "gcp" and self.headers.get("Metadata-Flavor") == "Google":
                    google = {"Metadata-Flavor": "Google"}
                    if url.path == "/computeMetadata/v1/":
                        return self._reply(200, b"instance/\n", google)
                    if url.path == "/computeMetadata/v1/instance/preempted":
                        query = parse_qs(url.query)
                        # a long poll waits while the value is the one the client saw (or, with no
                        # last_etag, until it changes), at most timeout_sec
                        if query.get("wait_for_change") == ["true"] and \
                                query.get("last_etag", [fake.gcp_etag()])[0] == fake.gcp_etag():
                            with fake.changed:
                                fake.changed.wait(float(query.get("timeout_sec", ["60"])[0]))
                        google["ETag"] = fake.gcp_etag()
                        if fake.answer is not None:
                            return self._reply(200, fake.answer, google)
                        return self._reply(200, b"TRUE" if fake.notice else b"FALSE", google)
                if fake.cloud == "azure" and self.headers.get("Metadata") == "true":
                    if url.path == "/metadata/instance":
                        return self._reply(200, b'{"compute": {"name": "vm-1"}}')
                    if url.path == "/metadata/instance/compute/name":
                        return self._reply(200, b"vm-1")
                    if url.path == "/metadata/scheduledevents":
                        if fake.answer is not None:
                            return self._reply(200, fake.answer)
                        return self._reply(200, json.dumps({"DocumentIncarnation": 1,
                                                            "Events": fake.notice or []}).encode())
                self._reply(404, b"")

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up waiting: expected
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gcp_etag(self) -> str:
        return f"etag-{bool(self.notice)}-{self.answer!r:.20}"

    def change(self, **fields) -> None:
        """Set fields (notice, answer, ...) and wake the long polls."""
        for key, value in fields.items():
            setattr(self, key, value)
        with self.changed:
            self.changed.notify_all()

    def close(self) -> None:
        self.change()
        self.server.shutdown()
        self.server.server_close()
