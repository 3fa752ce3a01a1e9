"""A real Ray cluster on loopback for a test or a benchmark: a head (`ray start --head --block`) and worker nodes
(`ray start --address HEAD --block`), each a raylet with its own ports, temp dir and HOME, stopped by
whoever started them, by their own process ids (never `ray stop`). A worker node can be
frozen (SIGSTOP to all its processes): a machine that vanished, which resets no connections."""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# Ray's own CLI, less `ray serve`'s commands: the `ray` script imports Serve (pandas, fastapi) to list
# them, 0.8 s of a core of the 1.6 a `ray start` costs here (measured); Ray's CLI leaves out a command
# group whose import fails, and this one is made to fail at once.
RAY_CLI = (sys.executable, "-c", "import sys; sys.modules['ray.serve.scripts'] = None; "
                                 "from ray.scripts.scripts import main; sys.exit(main())")
# No log monitor on these nodes: it forwards the workers' output to drivers that ask for it (Ray's
# log_to_driver), which elastic_zero's drivers do only with --worker-logs, never here; it cost 0.5 s of a
# core to start and about 1% of one a node while up (measured).
NO_LOG_MONITOR = ("--include-log-monitor", "false")

# Set (to anything), a stopped head's or node's temp dir stays, with Ray's logs; else it goes (2 MB a head,
# 0.2 MB a node: a suite's run left 12) unless its stop keeps it (a test's fixture, after a failure).
KEEP_DIRS_ENV = "ELASTIC_ZERO_KEEP_CLUSTER_DIRS"


def _remove_dir(path: str, keep: bool = False) -> None:
    if keep:
        print(f"kept {path}: Ray's logs of the cluster", file=sys.stderr)
    elif not os.environ.get(KEEP_DIRS_ENV):
        shutil.rmtree(path, ignore_errors=True)


PORT_NAMES = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port", "node-manager-port", "object-manager-port", "ray-client-server-port")


def _slot() -> int:
    """This process's place among those that start clusters side by side: a test process of
    pytest-xdist's by its number (gw0, gw1, ...: never the same two in one run), anything else by
    its pid."""
    xdist = os.environ.get("PYTEST_XDIST_WORKER", "")
    return 40 + int(xdist[2:]) % 10 if xdist[2:].isdigit() else os.getpid() % 40


# The ports the clusters' processes listen on (the GCS, the agents, a node's managers) come from a band
# of this process's own below the kernel's ephemeral range (32768 on): a port the kernel handed out by
# bind(0) was free only when asked, and any connection's source port, or another process's bind(0),
# may take it before Ray binds it (seen under load: a node's runtime env agent found its port taken,
# and the raylet, which shares its fate, ended 10 s after it had registered).
LISTEN_BAND, LISTEN_BAND_START = 55, 30000  # 50 slots: 30000-32749
_listen_cursor = 0


def listen_ports(count: int) -> list[int]:
    """`count` ports of this process's band that are free now, each handed out once in turn (the band
    wraps: clusters started earlier are stopped by then)."""
    global _listen_cursor
    base = LISTEN_BAND_START + _slot() * LISTEN_BAND
    ports: list[int] = []
    for _ in range(LISTEN_BAND):
        port = base + _listen_cursor % LISTEN_BAND
        _listen_cursor += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # a cluster of this process still holds it, or it lingers closing
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports left in this process's band {base}-{base + LISTEN_BAND - 1}")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it ended while /proc was read: no longer anyone's
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def processes_naming(text: str) -> list[int]:
    """The processes whose command line holds `text` (a cluster's temp dir), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    found.append(int(entry))
        except OSError:  # it ended while /proc was read: nothing left to stop
            continue
    return found


# job_status's looker: a status record (or the one-line error) for each job id read, one JSON line
# each after ANSWER; Ray prints lines of its own there too (a node marked dead, seen in CI)
ANSWER = "ez-status "
_STATUS_LOOKER = """
import json, sys
from elastic_zero.service.client import Client, ClusterError
client = Client(sys.argv[1])
for line in sys.stdin:
    try:
        answer = {"record": client.status(line.strip())}
    except ClusterError as exc:
        answer = {"error": str(exc)}
    print(%r + json.dumps(answer), flush=True)
""" % ANSWER


def drain_node(head, node_id: str, deadline_s: float) -> None:
    """`ray drain-node` as a cloud's preemption: the node goes in `deadline_s` seconds (whole ones)."""
    result = subprocess.run([*RAY_CLI, "drain-node", "--address",
                             head.gcs_address, "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                             "--reason-message", "spot instance reclaimed",
                             "--deadline-remaining-seconds", str(int(deadline_s))],
                            env=head.server_env, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"ray drain-node failed: {result.stderr.strip()[-500:]}")


class _RayletSlowToRegister(RuntimeError):
    """`ray start` gave up waiting for its raylet to register with the GCS."""


class RayHead:
    def __init__(self, auth: bool, num_cpus: int = 6, env: dict | None = None,
                 autoscaling_config: dict | None = None) -> None:
        """`autoscaling_config`: a cluster config of Ray's fake multi-node provider
        (autoscaled_cluster.py): the head runs Ray's autoscaler, which starts and stops worker nodes
        on this machine as their demand comes and goes."""
        self.dir = tempfile.mkdtemp(prefix="ezhead", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.home = os.path.join(self.dir, "home")
        os.makedirs(self.home)
        self.token = secrets.token_hex(16) if auth else None
        self.token_path = os.path.join(self.dir, "token")
        if auth:
            with open(self.token_path, "w") as fh:
                fh.write(self.token)
        # the workers' ports: a range of 200 of this process's slot (_slot), so that heads started side
        # by side take ranges apart; the ones its processes listen on, from its band (listen_ports)
        low = 20000 + _slot() * 200
        ports = dict(zip(PORT_NAMES, listen_ports(len(PORT_NAMES))))
        self.gcs_port, self.dashboard_port, self.metrics_port = ports["port"], ports["dashboard-port"], ports["metrics-export-port"]
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        self.worker_ports = (low, low + 200)
        extra = dict(env or {})
        env = self.client_env(**extra)
        env["RAY_AUTH_MODE"] = "token" if auth else "disabled"
        # Ray's own metrics interval (10 s), as a user's cluster has it: at 1 s (a test that reads the
        # metrics asks for it through `env`), every process of the cluster reports ten times as often,
        # measured at 5% of a core more for the raylets, agents and GCS beside a 4-worker job here
        # the jobs' entrypoints run `python` from the head's PATH: this interpreter's
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        self.server_env = env  # worker nodes start with it too
        self._poller: subprocess.Popen | None = None  # job_status's looker, started at the first look
        self._unread = b""  # what it wrote that was not read as an answer yet
        args = [*RAY_CLI, "start", "--head", "--block", *NO_LOG_MONITOR,
                "--node-ip-address", "127.0.0.1", "--temp-dir", os.path.join(self.dir, "ray"),
                "--num-cpus", str(num_cpus), "--disable-usage-stats", "--include-dashboard", "true",
                "--dashboard-host", "127.0.0.1", "--min-worker-port", str(low), "--max-worker-port", str(low + 99)]
        args += [f"--{name}={port}" for name, port in ports.items()]
        if autoscaling_config is not None:
            config = {**autoscaling_config, "provider": {**autoscaling_config["provider"], "gcs_address": self.gcs_address}}
            config_path = os.path.join(self.dir, "autoscaling.json")
            with open(config_path, "w") as fh:
                json.dump(config, fh)
            args += ["--autoscaling-config", config_path]
            env["RAY_FAKE_CLUSTER"] = "1"  # the fake provider refuses to start without it
        self.log = open(os.path.join(self.dir, "head.log"), "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

    def client_env(self, **extra) -> dict:
        """The environment of a client of this head: its own HOME (no ~/.ray/auth_token of the
        machine's) and the token's file as Ray's CLI would find it, RAY_AUTH_MODE left unset."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["HOME"] = self.home
        if self.token:
            env["RAY_AUTH_TOKEN_PATH"] = self.token_path
        env.update(extra)
        return env

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        request = urllib.request.Request(f"{self.address}/api/jobs/")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                printed = open(self.log.name).read()[-2000:]
                self.stop()
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {printed}")
            try:
                urllib.request.urlopen(request, timeout=2).read()
                return
            except OSError:  # not up yet: asked again until the deadline
                time.sleep(0.5)
        printed = open(self.log.name).read()[-2000:]
        self.stop()
        raise RuntimeError(f"the Ray head at {self.address} did not come up in {timeout_s:.0f} s: {printed}")

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM to `ray start --block` (which stops the processes it started, one by one), and
        after a few seconds SIGKILL to it and to whatever is left of its descendants. Its temp dir
        goes, unless `keep_dir`."""
        self._stop_poller()
        pids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pids += descendants(self.proc.pid)
                self.proc.kill()
                self.proc.wait()
        # the nodes an autoscaler started outlive the monitor that started them; every process of this
        # cluster names its temp dir
        for pid in pids + descendants(self.proc.pid) + processes_naming(self.dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        _remove_dir(self.dir, keep_dir)

    def run_job(self, work_dir: str, spec_file: str, job_id: str, args: tuple = ()) -> subprocess.Popen:
        """`elastic-zero run` of a spec in `work_dir` as this cluster's driver, outputs in
        `work_dir/out`, its console in `work_dir/driver.log`; `args`: more of run's options."""
        with open(os.path.join(work_dir, "driver.log"), "w") as log:
            return subprocess.Popen([sys.executable, "-m", "elastic_zero.cli", "run", spec_file, "--address",
                                     self.gcs_address, "--job-id", job_id, "--run-dir", os.path.join(work_dir, "out"),
                                     "--no-progress", *args], cwd=work_dir, env=self.client_env(), stdout=log,
                                    stderr=subprocess.STDOUT)

    def job_status(self, job_id: str, timeout_s: float = 60.0) -> dict | None:
        """A job's status record (`status --json`'s) through a direct connection; None while it has
        none, or when no answer came within `timeout_s` (CI saw a look hang for two minutes after its
        connection to the GCS timed out, on a loaded machine): the caller polls again until its own
        deadline. The looks go through one process of this head's that stays connected: a process
        each would import Ray and connect anew, 2-3 s of a core a look. One that does not answer in
        time is killed, and the next look starts another."""
        poller = self._poller
        if poller is None or poller.poll() is not None:
            poller = self._poller = subprocess.Popen(
                [sys.executable, "-c", _STATUS_LOOKER, self.gcs_address], env=self.client_env(), bufsize=0,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self._unread = b""
        try:
            poller.stdin.write(job_id.encode() + b"\n")
            line = self._answer(poller, time.monotonic() + timeout_s)
        except OSError:  # it ended as we asked
            line = ""
        if not line:
            self._stop_poller()
            return None
        return json.loads(line[len(ANSWER):]).get("record")

    def _answer(self, poller: subprocess.Popen, deadline: float) -> str:
        """The looker's next answer line ("" if none came by `deadline`), past Ray's own lines."""
        while True:
            *lines, self._unread = self._unread.split(b"\n")
            for i, line in enumerate(lines):
                at = line.find(ANSWER.encode())  # a line of Ray's may end where the answer begins
                if at >= 0:
                    self._unread = b"\n".join(lines[i + 1:] + [self._unread])
                    return line[at:].decode()
            ready, _, _ = select.select([poller.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(poller.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                return ""
            self._unread += chunk

    def _stop_poller(self) -> None:
        if self._poller is not None:
            self._poller.kill()
            self._poller.wait()
            self._poller = None

    def alive_nodes(self) -> list[dict]:
        """The nodes the head's state API reports alive."""
        request = urllib.request.Request(f"{self.address}/api/v0/nodes?limit=100&detail=1")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        reply = json.loads(urllib.request.urlopen(request, timeout=10).read())
        return [n for n in reply["data"]["result"]["result"] if n["state"] == "ALIVE"]


class RayNode:
    """A worker node of `head` on this machine, told apart by a resource of its own (`name`)."""

    def __init__(self, head: RayHead, name: str, num_cpus: int, index: int, attempts: int = 2) -> None:
        self.head, self.name, self.num_cpus, self.index = head, name, num_cpus, index
        for attempt in range(1, attempts + 1):
            self.dir = tempfile.mkdtemp(prefix=f"ez{name}", dir="/tmp")
            self._start()
            try:
                self.node_id = self._wait_registered()
                return
            except _RayletSlowToRegister:
                # Ray gives a raylet 30 s to register with the GCS; a loaded machine (seen in CI) can miss
                # that once. What the failed start left behind is stopped, and the node starts afresh.
                self._kill_leftovers()
                if attempt == attempts:
                    raise

    def _start(self) -> None:
        head = self.head
        names = ("node-manager-port", "object-manager-port", "runtime-env-agent-port", "metrics-export-port",
                 "dashboard-agent-listen-port", "dashboard-agent-grpc-port")
        low = head.worker_ports[0] + 100 + 25 * self.index  # the head's range goes on: [low, low + 24]
        picked = listen_ports(len(names))
        env = dict(head.server_env)
        args = [*RAY_CLI, "start", "--block", *NO_LOG_MONITOR, "--address", head.gcs_address,
                "--node-ip-address", "127.0.0.1", "--temp-dir", os.path.join(self.dir, "ray"),
                "--num-cpus", str(self.num_cpus), "--resources", json.dumps({self.name: 1}), "--disable-usage-stats",
                "--min-worker-port", str(low), "--max-worker-port", str(low + 24)]
        args += [f"--{n}={port}" for n, port in zip(names, picked)]
        self.log = open(os.path.join(self.dir, "node.log"), "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_registered(self, timeout_s: float = 90.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                printed = open(self.log.name).read()
                if "timed out during startup" in printed:
                    raise _RayletSlowToRegister(printed[-2000:])
                self._kill_leftovers()
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {printed[-2000:]}")
            try:
                nodes = self.head.alive_nodes()
            except OSError:  # the head's dashboard still warming up (seen: a connection closed unanswered)
                nodes = []
            for node in nodes:
                if self.name in node.get("resources_total", {}):
                    return node["node_id"]
            time.sleep(0.5)
        printed = open(self.log.name).read()[-2000:]
        self.stop()
        raise RuntimeError(f"node {self.name} did not join the cluster in {timeout_s:.0f} s: {printed}")

    def _kill_leftovers(self) -> None:
        """SIGKILL to every process of a failed start: `ray start` has exited, so they are no longer
        its descendants, but they are still in the process group it led (Ray's processes stay in it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        _remove_dir(self.dir)

    def processes(self) -> list[int]:
        return [self.proc.pid] + descendants(self.proc.pid)

    def freeze(self) -> None:
        """Every process of the node stops where it is: its connections stay open and say nothing."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass

    def stop(self, keep_dir: bool = False) -> None:
        """SIGKILL to the node's processes (a frozen node cannot stop itself); its temp dir goes,
        unless `keep_dir`."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()
        _remove_dir(self.dir, keep_dir)
