"""The coordinator's side of the heartbeats (heartbeats.py): a UDP socket drained by a process of
its own (beat_drain.py), and what the drains said: when each worker was last heard, where its
training stood, when that last moved.

Why drained rather than read as each arrives: a thread woken for each beat cost the coordinator
about 20 us a beat (7 us in a process of its own; the rest is its other threads' GIL), 211 us per
second per worker at ten beats a second. Drained every DRAIN_EVERY_S, a few workers cost no more
than one, and each beat a few us. Many workers fill the socket's buffer sooner (a kernel's
default holds about 500 beats: 50 ms of 1,024 workers'), so the wait shrinks with the rate of
beats (drain_wait_s). The drains run in a process of the listener's own (beat_drain.py), not in a
thread of the coordinator, whose GIL its loop holds for seconds when the world changes: a listener
late by more than its buffer loses beats, and live workers look silent. A drain is applied to
`heard` with one stamp, when it found the socket empty: after a stall every beat it then reads looks
fresh together, and no worker looks silent beside others only because its beat was read later in
the same drain (seen at 1,024 simulated workers: 238 declared lost in one go), or because the drain
that read it paused while it read (920, stamped with the paused drain's start).
"""

from __future__ import annotations

import functools
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from elastic_zero.wire import beat_drain
from elastic_zero.wire.beat_drain import read_frame
from elastic_zero.wire.heartbeats import LAST_WORD, POSITION_FIELDS, PROGRESS, Progress, beat_token, field_bytes

DRAIN_START_TIMEOUT_S = 30.0  # a Python's start on a loaded machine
MAX_DRAIN_RESTARTS = 5  # drain processes started again after one ended, in a listener's life
BEAT_BUFFER_BYTES = 2048  # what a beat takes of the socket's buffer, generously (Linux: about 830)
_progress = functools.partial(tuple.__new__, Progress)  # a Progress from its ten fields (0.6 us, its __new__ 1.0)


class HeartbeatListener:
    """The coordinator's side: a UDP socket on the node's cluster address, drained every DRAIN_EVERY_S
    or sooner by a process of its own (beat_drain.py), and a thread that applies what each drain read.
    `heard` maps actor id -> time.monotonic() when the drain that read its latest beat found the
    socket empty: at most a drain's wait after the beat came (more if the drain was late).
    `read_until` is that moment of the latest drain applied: every beat sent before it has been read
    (or was dropped, and then every member counts as heard), so a silence is measured up to it, not
    up to the clock's now: a coordinator too busy to apply the drains has not yet taken the beats of
    the time since, and the members would look silent for that time. Nothing read is lost meanwhile:
    the drains wait in the pipe, folded together."""

    def __init__(self, host: str, secret: bytes, buffer_bytes: int = 8 << 20) -> None:
        """`buffer_bytes`: the socket's receive buffer (8 MiB: about 10,000 beats, a second of 1,024 workers')."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)  # kept here for its drop count; read there only
        want = buffer_bytes
        try:  # past the kernel's cap (net.core.rmem_max), where the process may
            self._sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", socket.SO_RCVBUF), want)
        except OSError:  # not allowed to pass the cap: as large as the cap lets it be
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, want)
        self.capacity = max(1, self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // BEAT_BUFFER_BYTES)
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.heard: dict[str, float] = {}
        # actor id -> Progress of its latest beat (the last word of an ended worker's beat process)
        self.progress = ProgressBook()
        # actor id -> when its progress last moved (a beat whose position differed from its previous one's)
        self.moved: dict[str, float] = {}
        self.longest_pause_s = 0.0  # the longest a drain came later than planned (the drain process's)
        self.longest_lag_s = 0.0  # the longest from a drain's start until it was applied here
        self.dropped = 0  # beats the kernel dropped, its buffer full (socket_drops)
        self.overflows = 0  # drains after which every member was presumed heard, beats having been dropped
        self.read_until = time.monotonic()
        self.ended = False  # the drain process ended while the listener was open and could not be started again
        self.drain_restarts = 0  # drain processes started again after one ended
        self._closing = False
        self._config = {"token": beat_token(secret).hex(), "progress_bytes": PROGRESS.size,
                        "position_bytes": field_bytes(PROGRESS.format, POSITION_FIELDS),
                        "last_word": LAST_WORD, "capacity": self.capacity}
        self._drain = None
        self._lock = threading.Lock()  # a drain started and close(), which ends the current one
        self._restarted = False  # the drain died and another started: its first frame presumes everyone heard
        error = self._start_drain()
        if error is not None:
            self.close()
            raise RuntimeError(error)
        threading.Thread(target=self._apply_drains, daemon=True, name="heartbeats").start()

    def _start_drain(self) -> str | None:
        """A drain process on the socket, ready (its first, empty drain read): a beat sent after this
        returns is read on time. None, or why it did not start."""
        # in a session of its own, as a worker's beat process: where the kernel groups processes by session
        # (autogroup), its share of the CPU is its own, not one thread's among the coordinator's
        known = {a: body.hex() for a, body in list(self.progress.raw.items())}  # (none at the first start)
        with self._lock:
            if self._closing:
                return "the heartbeat listener is closing"
            try:
                drain = subprocess.Popen([sys.executable, "-I", beat_drain.__file__, str(self._sock.fileno())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         pass_fds=(self._sock.fileno(),), start_new_session=True)
            except OSError as exc:
                return f"the heartbeat listener's drain process could not start: {exc}"
            self._drain = drain
        try:  # (close() may end it meanwhile: its pipes closed under us)
            drain.stdin.write(json.dumps({**self._config, "known": known}).encode() + b"\n")
            drain.stdin.flush()
            started = select.poll()  # (not select(): a coordinator may hold descriptors past its limit of 1,024)
            started.register(drain.stdout, select.POLLIN)
            if started.poll(DRAIN_START_TIMEOUT_S * 1000) and read_frame(drain.stdout) is not None:
                return None
        except (OSError, ValueError) as exc:
            return f"the heartbeat listener's drain process ended as it started: {exc}"
        return f"the heartbeat listener's drain process did not start within {DRAIN_START_TIMEOUT_S:g} s"

    @property
    def drain_pid(self) -> int:
        return self._drain.pid

    @property
    def drain_nice(self) -> int | None:
        """The drain process's niceness (beat_drain.AHEAD_NICE where the kernel allowed it; None: it ended)."""
        drain = self._drain
        if drain is None or drain.poll() is not None:  # (its pid may be another process's by now)
            return None
        try:
            return os.getpriority(os.PRIO_PROCESS, drain.pid)
        except OSError:  # the drain process is gone: said as None (and `ended`)
            return None

    def _apply_drains(self) -> None:
        """Applies the drains as they come; a drain process that ended (killed, a bug) is started again,
        up to MAX_DRAIN_RESTARTS times, at once (a slow start leaves the listener blind for up to
        DRAIN_START_TIMEOUT_S). Meanwhile nothing is applied, so `read_until` stays and nobody looks
        silent for the gap; the beats wait in the socket. The new process starts from each member's
        latest progress, so nobody counts as moved for it; what the dead one had read and not yet
        written is lost uncounted, so its first frame presumes everyone heard, as after drops."""
        while True:
            self._apply_frames()
            if self._closing:
                return
            self._end_drain()
            while True:  # another, until one starts or the restarts run out
                if self.drain_restarts >= MAX_DRAIN_RESTARTS or self._closing:
                    self.ended = not self._closing
                    return
                self.drain_restarts += 1
                if self._start_drain() is None:
                    self._restarted = True
                    break
                self._end_drain()

    def _end_drain(self) -> None:
        """The drain process's end, waited for (it ended, or did not start in time: killed)."""
        drain = self._drain
        if drain is None:  # none started
            return
        for stream in (drain.stdin, drain.stdout):
            try:
                stream.close()
            except OSError:  # its stdin's pipe broken: it is gone already
                pass
        drain.kill()
        drain.wait()

    def _apply_frames(self) -> None:
        while True:
            try:
                frame = read_frame(self._drain.stdout)
            except (OSError, ValueError):  # its pipe closed under the read by close()
                frame = None
            if frame is None:
                return
            latest, dropped, longest_pause_s, heard_by_drain, changed, moved = frame
            self.longest_pause_s = max(self.longest_pause_s, longest_pause_s)  # (a new process counts afresh)
            # one update each (atomic under the GIL): readers see all of a frame or none of it
            for at in sorted(heard_by_drain):
                self.heard.update(dict.fromkeys(heard_by_drain[at], at))
            lost = dropped > self.dropped  # beats were lost before the latest drain began, whose is unknown
            if lost:
                self.dropped, self.overflows = dropped, self.overflows + 1
            if lost or self._restarted:  # (a dead drain's unwritten beats are lost alike): nobody's silence
                self.heard.update(dict.fromkeys(self.heard, latest))  # counts across it (after the drains)
            self._restarted = False
            self.progress.raw.update(changed)  # unpacked when read
            self.moved.update(moved)  # (the drain compared the positions' bytes)
            self.read_until = latest  # after heard: a reader never sees it ahead of what was read
            self.longest_lag_s = max(self.longest_lag_s, time.monotonic() - latest)

    def starved_s(self, actor_id: str) -> float:
        """How long `actor_id`'s process waited for a CPU since its training last moved, as its latest
        beat said (cpu_waits.StillnessMeter; 0: not known)."""
        progress = self.progress.get(actor_id)
        return progress.waited_ms / 1000 if progress is not None else 0.0

    def close(self) -> None:
        with self._lock:  # no drain starts after this
            self._closing = True
            drain = self._drain
        if drain is not None:
            try:
                drain.stdin.close()  # its end: the drain process exits at once
            except OSError:  # (its pipe broken: it ended)
                pass
            try:
                drain.wait(5)
            except subprocess.TimeoutExpired:
                drain.kill()
                drain.wait()
            drain.stdout.close()
        self._sock.close()


class ProgressBook(Mapping):
    """actor id -> Progress of its latest beat, kept as the beat's bytes and unpacked when read. A
    real worker's memory figures change at every beat, so every beat brings new bytes (10,240 a
    second at 1,024 workers), while the coordinator reads them a few times a second (its memory view,
    the stuck rule's candidates, a status). The listener's thread adds to `raw` while others read:
    every read takes its own copy of what it walks (a dict's copy is one step under the GIL)."""

    def __init__(self) -> None:
        self.raw: dict[str, bytes] = {}

    def __getitem__(self, actor_id: str) -> "Progress":
        return _progress(PROGRESS.unpack(self.raw[actor_id]))

    def __iter__(self):
        return iter(list(self.raw))

    def __len__(self) -> int:
        return len(self.raw)

    def __contains__(self, actor_id) -> bool:
        return actor_id in self.raw

    def items(self) -> list:
        unpack = PROGRESS.unpack
        return [(a, _progress(unpack(body))) for a, body in list(self.raw.items())]
