"""Heartbeats as UDP datagrams: each worker tells the coordinator it is alive every HEARTBEAT_EVERY_S
(job/sections.py), and the coordinator notes when it last heard of each (plan/liveness.py reads that).

Why not a Ray actor call each: on a two-core machine a Ray actor spends about 320 us of its own
CPU per call received, so 1,024 workers beating ten times a second would need three cores in the
coordinator alone. A datagram costs the coordinator one recvfrom and a dict write (a few us), and a
lost datagram is just a missed beat: the timeout is several beats long.

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


def beat_token(secret: bytes) -> bytes:
    return hmac.new(secret, b"elastic-zero heartbeat", hashlib.sha256).digest()[:TOKEN_BYTES]


class HeartbeatListener:
    """The coordinator's side: a UDP socket on the node's cluster address and a thread that notes each
    beat. `heard` maps actor id -> time.monotonic() of its latest beat."""

    def __init__(self, host: str, secret: bytes) -> None:
        self._token = beat_token(secret)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # a burst of 1,024 beats at once
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.heard: dict[str, float] = {}
        # the longest wait between two datagrams: with many workers beating, a long one means this
        # thread was starved, and silences read meanwhile are the listener's, not the workers'
        self.longest_pause_s = 0.0
        threading.Thread(target=self._listen, daemon=True, name="heartbeats").start()

    def _listen(self) -> None:
        token, n, heard, clock = self._token, TOKEN_BYTES, self.heard, time.monotonic
        recv = self._sock.recv
        last = None  # counted from the first beat: before it, no worker had started
        while True:
            try:
                datagram = recv(MAX_DATAGRAM)
            except OSError:  # closed: the job is over
                return
            now = clock()
            if last is not None and now - last > self.longest_pause_s:
                self.longest_pause_s = now - last
            last = now
            if datagram[:n] == token:
                heard[datagram[n:].decode(errors="replace")] = now

    def close(self) -> None:
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
