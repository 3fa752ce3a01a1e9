"""Heartbeats as UDP datagrams: each worker tells the coordinator it is alive every HEARTBEAT_EVERY_S
(job/sections.py), and the coordinator notes when it last heard of each (plan/liveness.py reads that).

Why not a Ray actor call each: on a two-core machine a Ray actor spends about 320 us of its own
CPU per call received, so 1,024 workers beating ten times a second would need three cores in the
coordinator alone. A datagram costs the coordinator one recv and a dict write (about 2 us), and a
lost datagram is just a missed beat: the timeout is several beats long.

Why drained rather than read as each arrives: a thread woken for each beat cost the coordinator
about 20 us a beat (7 us in a process of its own; the rest is its other threads' GIL), 211 us per
second per worker at ten beats a second. Drained every DRAIN_EVERY_S, a few workers cost no more
than one, and each beat about 2 us. Many workers fill the socket's buffer sooner (a kernel's
default holds about 500 beats: 50 ms of 1,024 workers'), so the wait shrinks with the rate of
beats (drain_wait_s). A drain is applied to `heard` at once, stamped with when it began: after a
stall of the listener every beat it then reads looks fresh together, and no worker looks silent
beside others only because its beat was read later in the same drain (seen at 1,024 simulated
workers: 238 declared lost in one go).

A beat is the job's beat token and the worker's actor id. The token is derived from the job's
rendezvous secret (which never leaves Ray), so a datagram from outside the job is dropped; it
travels in the clear, and whoever reads it off the wire could keep a dead worker "heard". Then the
collective timeout still ends the generation, as without heartbeats.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

TOKEN_BYTES = 16
MAX_DATAGRAM = 512  # a token and an actor id
DRAIN_EVERY_S = 0.05  # the longest wait between two drains of the listener's socket
MIN_DRAIN_WAIT_S = 0.002
BEAT_BUFFER_BYTES = 2048  # what a beat takes of the socket's buffer, generously (Linux: about 830)


def beat_token(secret: bytes) -> bytes:
    return hmac.new(secret, b"elastic-zero heartbeat", hashlib.sha256).digest()[:TOKEN_BYTES]


def drain_wait_s(beats: int, over_s: float, capacity: int) -> float:
    """How long to wait before the next drain, after `beats` came in `over_s`: DRAIN_EVERY_S, or less
    where beats at that rate would fill half of the socket's `capacity` (in beats) before it."""
    if beats <= 0 or over_s <= 0:
        return DRAIN_EVERY_S
    return min(DRAIN_EVERY_S, max(MIN_DRAIN_WAIT_S, capacity / 2 / (beats / over_s)))


class HeartbeatListener:
    """The coordinator's side: a UDP socket on the node's cluster address and a thread that drains it
    every DRAIN_EVERY_S or sooner. `heard` maps actor id -> time.monotonic() at the start of the drain
    that read its latest beat: at most a drain's wait after the beat came."""

    def __init__(self, host: str, secret: bytes) -> None:
        self._token = beat_token(secret)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        want = 8 << 20  # about 10,000 beats: a second of 1,024 workers'
        try:  # past the kernel's cap (net.core.rmem_max), where the process may
            self._sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", socket.SO_RCVBUF), want)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
        self.capacity = max(1, self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // BEAT_BUFFER_BYTES)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self.heard: dict[str, float] = {}
        # the longest a drain came later than planned: a long one means this thread was starved
        self.longest_pause_s = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._listen, daemon=True, name="heartbeats").start()

    def _listen(self) -> None:
        token, n, clock, recv = self._token, TOKEN_BYTES, time.monotonic, self._sock.recv
        wait, previous = DRAIN_EVERY_S, clock()
        while not self._closed.wait(wait):
            started = clock()
            self.longest_pause_s = max(self.longest_pause_s, started - previous - wait)
            beats, ids = 0, set()
            while True:
                try:
                    datagram = recv(MAX_DATAGRAM)
                except BlockingIOError:  # drained
                    break
                except OSError:  # closed: the job is over
                    return
                beats += 1
                if datagram[:n] == token:
                    ids.add(datagram[n:])
            # one update (atomic under the GIL): readers see all of this drain or none of it
            self.heard.update({i.decode(errors="replace"): started for i in ids})
            wait, previous = drain_wait_s(beats, started - previous, self.capacity), started

    def close(self) -> None:
        self._closed.set()
        self._sock.close()


class HeartbeatSender:
    """A worker's side (one socket per process, whichever workers it beats for): `token` is
    beat_token() of the job's secret."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self._token, self._target = token, (host, port)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)

    def beat(self, actor_id: str) -> None:
        try:
            self._sock.sendto(self._token + actor_id.encode(), self._target)
        except OSError:  # a beat lost (the network, the coordinator gone): the next one counts
            pass


def start_beat_process(host: str, port: int, token: bytes, actor_id: str, every_s: float) -> subprocess.Popen:
    """A worker's beats, from a process of its own (this file run as a script, standard library only).

    Why not a thread of the worker: the worker's own work stalls its threads. A thread needs the GIL,
    which a long call that holds it (unpickling a large state, a garbage collection over millions of
    objects, an extension that does not release it) keeps for seconds, and on a busy machine the
    worker's process competes for the cores: a worker stalled for a second, alive and training, was
    declared lost in CI. A process that sleeps between beats is woken on time by the kernel whatever
    its parent does. What beats then says is "this worker's process and node are alive": its death is
    Ray's to report (its pipe closes, and the beat process ends with it), and a worker hung while alive
    is found by the collective timeout, as before.

    It ignores SIGTERM and SIGINT, in a session of its own: a worker told to go by SIGTERM keeps
    beating through its grace period, while it hands its shard over.

    Its first beat is sent before it says so on its stdout (beating_started): a worker's hello waits
    for that, because the coordinator counts a member's silence from the generation it joins. A
    worker ready last starts that generation at once, and its beat process, a Python started on a
    busy machine, could take over a second to send its first beat: that worker was declared lost,
    alive and well (seen in CI)."""
    proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    config = {"host": host, "port": port, "token": token.hex(), "actor_id": actor_id, "every_s": every_s}
    proc.stdin.write(json.dumps(config).encode() + b"\n")
    proc.stdin.flush()
    return proc


def beating_started(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the beat process sent its first beat within `timeout_s` (False: it did not, or ended)."""
    readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
    started = bool(readable) and proc.stdout.read(1) == b"+"
    if readable:
        proc.stdout.close()
    return started


def _beat_process() -> None:
    """start_beat_process's side: a beat every `every_s` until its stdin ends (the worker is gone)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = json.loads(sys.stdin.buffer.readline() or b"null")
    if not config:  # the worker went before it said where to beat
        return
    sender = HeartbeatSender(config["host"], config["port"], bytes.fromhex(config["token"]))
    actor_id, every_s, stdin = config["actor_id"], config["every_s"], sys.stdin.fileno()
    next_beat = time.monotonic()
    sender.beat(actor_id)
    try:
        os.write(1, b"+")  # the first beat is out (beating_started)
        os.close(1)
    except OSError:  # the worker stopped listening: it goes, and this process with it (its stdin ends)
        pass
    while True:
        next_beat = max(next_beat + every_s, time.monotonic())  # late (stopped, starved): on from now
        readable, _, _ = select.select([stdin], [], [], max(0.0, next_beat - time.monotonic()))
        if readable and not os.read(stdin, 4096):  # EOF: the worker's process is gone
            return
        sender.beat(actor_id)


if __name__ == "__main__":  # start_beat_process's child
    _beat_process()
