"""Heartbeats as UDP datagrams: each worker tells the coordinator it is alive every HEARTBEAT_EVERY_S
(job/sections.py), and the coordinator notes when it last heard of each (plan/liveness.py reads that).

Why not a Ray actor call each: on a two-core machine a Ray actor spends about 320 us of its own
CPU per call received, so 1,024 workers beating ten times a second would need three cores in the
coordinator alone. A datagram costs the coordinator one recv and a dict write (about 1 us), and a
lost datagram is just a missed beat: the timeout is several beats long.

Why drained every DRAIN_EVERY_S rather than read as each arrives: a thread woken for each beat
cost the coordinator about 20 us a beat (7 us in a process of its own; the rest is its other
threads' GIL), 211 us per second per worker at ten beats a second. Ten drains a second cost the
same for 3 workers as for 1,024, and each beat then about 1 us.

A beat is the job's beat token and the worker's actor id. The token is derived from the job's
rendezvous secret (which never leaves Ray), so a datagram from outside the job is dropped; it
travels in the clear, and whoever reads it off the wire could keep a dead worker "heard". Then the
collective timeout still ends the generation, as without heartbeats.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading
import time

TOKEN_BYTES = 16
MAX_DATAGRAM = 512  # a token and an actor id
DRAIN_EVERY_S = 0.1  # how often the listener reads what has arrived (each beat is stamped then, see _listen)


def beat_token(secret: bytes) -> bytes:
    return hmac.new(secret, b"elastic-zero heartbeat", hashlib.sha256).digest()[:TOKEN_BYTES]


class HeartbeatListener:
    """The coordinator's side: a UDP socket on the node's cluster address and a thread that drains it
    every DRAIN_EVERY_S. `heard` maps actor id -> a time.monotonic() its sender was surely alive
    after (see _listen)."""

    def __init__(self, host: str, secret: bytes, drain_every_s: float = DRAIN_EVERY_S) -> None:
        self._token, self._drain_every_s = beat_token(secret), drain_every_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        # the beats of 1,024 workers over a drain's interval and more, should the thread be late
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self.heard: dict[str, float] = {}
        # the longest wait between two drains past DRAIN_EVERY_S: a long one means this thread was
        # starved, and silences read meanwhile are the listener's, not the workers'
        self.longest_pause_s = 0.0
        self._closed = threading.Event()
        threading.Thread(target=self._listen, daemon=True, name="heartbeats").start()

    def _listen(self) -> None:
        token, n, heard, clock, recv = self._token, TOKEN_BYTES, self.heard, time.monotonic, self._sock.recv
        # a beat read in this drain arrived after the previous drain emptied the socket: its sender
        # was alive then. Stamping that time, not the drain's, never makes a silence look shorter
        # than it is, so a lost node is declared no later than with exact stamps
        emptied_at = clock()
        while not self._closed.wait(self._drain_every_s):
            started = clock()
            self.longest_pause_s = max(self.longest_pause_s, started - emptied_at - self._drain_every_s)
            while True:
                try:
                    datagram = recv(MAX_DATAGRAM)
                except BlockingIOError:  # drained
                    break
                except OSError:  # closed: the job is over
                    return
                if datagram[:n] == token:
                    heard[datagram[n:].decode(errors="replace")] = emptied_at
            emptied_at = clock()

    def close(self) -> None:
        self._closed.set()
        self._sock.close()


class HeartbeatSender:
    """A worker's side (one socket per process, whichever workers it beats for)."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._token, self._target = beat_token(secret), (host, port)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)

    def beat(self, actor_id: str) -> None:
        try:
            self._sock.sendto(self._token + actor_id.encode(), self._target)
        except OSError:  # a beat lost (the network, the coordinator gone): the next one counts
            pass
