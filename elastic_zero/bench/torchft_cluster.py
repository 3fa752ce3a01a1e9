"""The torchft side's processes on this machine: a lighthouse and replica groups, each group one
process in a session of its own (so that a "node" of them can be frozen or killed whole), with a
TCPStore of its own hosted here, as torchrun would give it. Whoever holds the cluster is the
supervisor: it starts groups, freezes and kills them as the schedule says, and is told of any other
exit as an error naming the group and its last line of output. `stop()` ends everything started.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

from elastic_zero.testing.local_cluster import listen_ports

MISSING = "torchft is not installed: pip install -e '.[anchors]' (the comparisons' extra)"


def lighthouse_command() -> str | None:
    """torchft's lighthouse executable: beside this interpreter (a virtual environment not on PATH),
    else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")


def torchft_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchft") is not None and lighthouse_command() is not None


def last_line(path: str) -> str:
    with open(path, "rb") as fh:
        lines = [line for line in fh.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


class TorchftCluster:
    """`config` goes to every group (`bench/torchft_job.py` reads it); `slots` is how many shares
    the global batch is cut into, one per group that may run at once."""

    def __init__(self, config: dict, slots: int, work_dir: str) -> None:
        import torch.distributed as dist

        if not torchft_installed():
            raise ValueError(MISSING)
        self._dist = dist
        self.work_dir = work_dir
        os.makedirs(work_dir, exist_ok=True)
        self.log = os.path.join(work_dir, "torchft_steps.jsonl")
        self.config_path = os.path.join(work_dir, "torchft_config.json")
        with open(self.config_path, "w") as fh:
            json.dump({**config, "groups": slots, "log": self.log}, fh)
        self.procs: dict[int, subprocess.Popen] = {}  # slot -> its group's process, while expected to run
        self._stores: dict[int, object] = {}
        self.started = 0
        (port,) = listen_ports(1)  # not bind(0)'s: another process may take that before the lighthouse binds it
        with open(os.path.join(work_dir, "lighthouse.log"), "wb") as log:  # the child keeps its own descriptor
            self.lighthouse = subprocess.Popen(
                [lighthouse_command(), "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                 "--bind", f"[::]:{port}"], stdout=log, stderr=subprocess.STDOUT)
        self._env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "MASTER_ADDR": "127.0.0.1",
                     "RANK": "0", "WORLD_SIZE": "1"}

    def __enter__(self) -> "TorchftCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, slot: int) -> None:
        """A new process for the slot, with a fresh store (nothing left from the slot's last process)."""
        if slot in self.procs:
            raise RuntimeError(f"torchft replica group {slot} is already running")
        self._stores[slot] = self._dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with open(os.path.join(self.work_dir, f"group-{slot}.log"), "ab") as log:
            self.procs[slot] = subprocess.Popen(
                [sys.executable, "-m", "elastic_zero.bench.torchft_job", self.config_path, str(slot)],
                env={**self._env, "MASTER_PORT": str(self._stores[slot].port)}, start_new_session=True,
                stdout=log, stderr=subprocess.STDOUT)
        self.started += 1

    def freeze(self, slot: int) -> None:
        """SIGSTOP: a machine that vanished, which resets no connection. The group stays expected
        (a frozen process does not exit) until it is killed."""
        os.killpg(self.procs[slot].pid, signal.SIGSTOP)

    def kill(self, slot: int) -> None:
        """SIGKILL to the group's whole session; it is no longer expected to run."""
        proc = self.procs.pop(slot)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had exited on its own already
            pass
        proc.wait()

    def wait_exits(self, timeout_s: float) -> dict[int, int]:
        """Waits (on pidfds) until a group or the lighthouse exits, or the timeout passes; returns
        {slot: exit code} of the groups that exited, forgetting them. The lighthouse's exit is an error."""
        watched = [self.lighthouse, *self.procs.values()]
        fds = [os.pidfd_open(p.pid) for p in watched]
        try:
            select.select(fds, [], [], max(0.0, timeout_s))
        finally:
            for fd in fds:
                os.close(fd)
        if self.lighthouse.poll() is not None:
            raise RuntimeError(f"the torchft lighthouse exited with {self.lighthouse.returncode}; see {self.work_dir}")
        ended = {slot: proc.returncode for slot, proc in self.procs.items() if proc.poll() is not None}
        for slot in ended:
            del self.procs[slot]
        return ended

    def failed(self, slot: int, code: int) -> RuntimeError:
        """The error for a group's exit nobody planned: its slot, code and last line of output."""
        return RuntimeError(f"torchft replica group {slot} exited with {code}: "
                            f"{last_line(os.path.join(self.work_dir, f'group-{slot}.log'))}")

    def records(self) -> list[dict]:
        """Every group's step log lines, in the order written."""
        if not os.path.exists(self.log):
            return []
        with open(self.log) as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]

    def stop(self) -> None:
        for slot in list(self.procs):
            self.kill(slot)
        if self.lighthouse.poll() is None:
            self.lighthouse.kill()
            self.lighthouse.wait()
        self._stores.clear()


def supervise(cluster: TorchftCluster, done, timeout_s: float, what: str, planned=lambda slot, code: False) -> None:
    """Watches the groups until `done()` holds: an exit with 0 is a group that finished, one that
    `planned(slot, code)` accepts is the caller's, any other is an error; so is `what` not done
    within the timeout."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the torchft run did not {what} within {timeout_s:.0f} s; see {cluster.work_dir}")
        for slot, code in cluster.wait_exits(min(0.5, deadline - time.monotonic())).items():
            if code != 0 and not planned(slot, code):
                raise cluster.failed(slot, code)
