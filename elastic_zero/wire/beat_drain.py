"""The heartbeat listener's drain: a process of its own that reads the coordinator's heartbeat socket
and tells the coordinator, a drain at a time, whom it heard and whose progress changed.

Why a process, not a thread of the coordinator: a thread needs the coordinator's GIL, which its loop
holds for long stretches when the world changes (a thousand reports read, a thousand train calls
made, a garbage collection), and on a busy machine that loop's process waits for a core besides.
A listener that drains late loses beats once the socket's buffer is full, and then live workers
look silent: at 1,024 simulated workers on two cores the listener thread's longest pause reached
7-11.7 s, the kernel dropped 56,861 beats in one run, and live workers were declared lost by the
hundreds (the job started over from step 0). This process sleeps between drains and is woken by
the kernel whatever the coordinator's GIL does; what it read waits in a pipe until the coordinator takes it (a drain's
updates are applied in order, so nothing read is lost, only told late). It cannot help a machine
that gives it no CPU: on two cores at 1,024 simulated workers it still paused 1.5-3.7 s at the
niceness it inherits (Ray's 15), and 0.1-0.4 s run ahead (run_ahead).

Standard library only: beat_listener.py starts it by path (`python -I beat_drain.py <socket fd>`)
with one line of JSON on its stdin (the beat token, the size of a beat's progress and the byte
ranges of its position, the last-word flag, the socket's capacity in beats; for a drain started again
after one died, each member's latest progress, so that no member counts as moved for its restart). It
ends when its stdin ends (the coordinator is gone).

On its stdout, one frame per drain it could write (4 bytes of length, then a pickle): (the stamp of
the latest drain it folds in, monotonic: when it found the socket empty, every beat that came before
read; the socket's drops as that drain began; its longest pause so far; {drain stamp: [actor ids
heard then]}; {actor id: progress bytes that changed}; {actor id: the drain that read its position
change}). The positions are compared here, bytes against bytes:
at 1,024 workers whose steps move four times a second, the coordinator compared 4,096 pairs of
tuples a second, on the GIL its loop needs. Frames that could not be written at once (the
coordinator not reading) are folded into the next: each id keeps the latest drain it was heard in,
its latest progress, and the latest drain it moved in.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import select
import socket
import struct
import sys
import time

DRAIN_EVERY_S = 0.05  # the longest wait between two drains of the listener's socket
MIN_DRAIN_WAIT_S = 0.002
MAX_DATAGRAM = 512  # a token, the progress and an actor id
_SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)  # Linux: nine u32 counters, the drops the ninth
FRAME_HEAD = struct.Struct("<I")
AHEAD_NICE = -5  # the niceness of the processes that must run on time (this drain, each worker's beats)
AUTOGROUP_TRIES = 5


def run_ahead(nice: int = AHEAD_NICE) -> bool:
    """Have this process run ahead of its node's busy ones, where the kernel allows it (root, or
    CAP_SYS_NICE; a container without it runs it as any other): its niceness, and that of its
    session's autogroup, since it runs in a session of its own and the kernel (sched_autogroup, for
    processes in the root cpu cgroup) weighs sessions against each other before processes. Otherwise
    it keeps its parent's: Ray starts its workers, the coordinator among them, at niceness 15
    (worker_niceness). A drain or a beat that comes late looks, at the coordinator, like a node that
    vanished. Light work (a few us a beat) and mostly asleep, so it takes little from the rest.
    Whether the kernel allowed the niceness."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        return False
    for _ in range(AUTOGROUP_TRIES):
        try:
            with open("/proc/self/autogroup", "w") as fh:
                fh.write(str(nice))
            break
        except BlockingIOError:  # one such write per 100 ms on the machine without CAP_SYS_ADMIN
            time.sleep(0.11)
        except OSError:  # no autogroups (a kernel without them, or turned off): the niceness is all
            break
    return True


def drain_wait_s(beats: int, over_s: float, capacity: int) -> float:
    """How long to wait before the next drain, after `beats` came in `over_s`: DRAIN_EVERY_S, or less
    where beats at that rate would fill half of the socket's `capacity` (in beats) before it."""
    if beats <= 0 or over_s <= 0:
        return DRAIN_EVERY_S
    return min(DRAIN_EVERY_S, max(MIN_DRAIN_WAIT_S, capacity / 2 / (beats / over_s)))


def socket_drops(sock: socket.socket) -> int:
    """How many datagrams the kernel dropped at `sock`, its receive buffer full (Linux's SO_MEMINFO;
    0 where it cannot be read). When the listener falls behind, the beats that find the buffer full
    are lost, a host's burst at a time: seen at 1,024 simulated workers, a listener 2 s late read the
    buffered beats of some hosts and none of others', and 656 live workers looked silent for 1.9 s
    beside 432 heard."""
    try:
        return struct.unpack_from("9I", sock.getsockopt(socket.SOL_SOCKET, _SO_MEMINFO, 36))[8]
    except (OSError, struct.error):
        return 0


class _Pending:
    """What was read and not yet written to the coordinator: folded drain by drain."""

    def __init__(self, drops: int = 0) -> None:
        self.heard: dict[str, float] = {}  # actor id -> the latest drain it was heard in
        self.changed: dict[str, bytes] = {}  # actor id -> its latest progress that differed from the one before
        self.moved: dict[str, float] = {}  # actor id -> the latest drain that read its position changed
        self.latest = None  # the latest drain's stamp (when it found the socket empty)
        self.drops = drops  # the socket's drops as the latest drain began

    def drained(self, stamp: float, drops: int) -> None:
        """A drain stamped `stamp` is folded in; the socket had dropped `drops` when it began.
        The drops are taken here, not when the frame is written: a frame that waited for the pipe would
        carry the drops of the time since, and the coordinator would count every member heard at a
        drain that ended before they happened, while the next drain, which lacks the lost beats, told
        of no drops (seen at 1,024 simulated workers: 616 live workers declared silent)."""
        self.latest, self.drops = stamp, drops

    def frame(self, longest_pause_s: float) -> bytes:
        by_drain: dict[float, list[str]] = {}
        for actor_id, at in self.heard.items():
            by_drain.setdefault(at, []).append(actor_id)
        body = pickle.dumps((self.latest, self.drops, longest_pause_s, by_drain, self.changed, self.moved),
                            protocol=pickle.HIGHEST_PROTOCOL)
        return FRAME_HEAD.pack(len(body)) + body


def drain_forever(sock: socket.socket, config: dict, stdin_fd: int, stdout_fd: int) -> None:
    token = bytes.fromhex(config["token"])
    n, last_word, capacity = len(token), config["last_word"], config["capacity"]
    head = n + config["progress_bytes"]
    spans = [slice(start, end) for start, end in config["position_bytes"]]
    clock, recv = time.monotonic, sock.recv
    bodies: dict[bytes, bytes] = {}  # actor id (as sent) -> its latest progress bytes
    positions: dict[bytes, bytes] = {}  # actor id (as sent) -> the position bytes of its latest progress
    names: dict[bytes, str] = {}  # actor id as sent -> as a str (decoded once)
    for actor_id, body in config.get("known", {}).items():  # a drain started again: what the last one read
        ident, body = actor_id.encode(), bytes.fromhex(body)
        bodies[ident], positions[ident], names[ident] = body, b"".join([body[span] for span in spans]), actor_id
    pending, unsent = _Pending(), b""
    wait, previous, longest_pause = DRAIN_EVERY_S, clock(), 0.0
    pending.drained(clock(), 0)
    try:
        os.write(stdout_fd, pending.frame(0.0))  # ready: the coordinator waits for this first, empty drain
    except BrokenPipeError:  # the coordinator is gone (started again as Ray ended its children first)
        return
    pending = _Pending()
    os.set_blocking(stdout_fd, False)
    while True:
        writable = [stdout_fd] if unsent else []
        readable, can_write, _ = select.select([stdin_fd], writable, [], max(0.0, previous + wait - clock()))
        if readable and not os.read(stdin_fd, 4096):  # the coordinator is gone
            return
        if can_write:
            unsent = _write(stdout_fd, unsent)
            if not unsent and pending.latest is not None:  # what was folded while the pipe was full
                unsent, pending = _write(stdout_fd, pending.frame(longest_pause)), _Pending(pending.drops)
        if clock() < previous + wait:
            continue
        # the drops before the drain's start, read first: each is told with a drain stamped after it, so
        # that none makes members heard at a moment before their beats were lost (a drop counted after
        # the reads, the process paused meanwhile, was told with a stamp ahead of it)
        drops = socket_drops(sock)
        started = clock()
        longest_pause = max(longest_pause, started - previous - wait)
        # what this drain read is stamped with a moment it found the socket empty (every beat that came
        # before it read), not with its start: a drain paused while it read (1.39 s, at 1,024 simulated
        # workers on two cores) read beats through the pause, and stamped with its start, they looked
        # that much older than the next drain's few: 920 live workers declared silent. The clock is read
        # once the socket looks empty, and the drain ends only if it is still empty after (no clock per beat)
        beats, said, emptied_at = 0, {}, None
        while True:
            try:
                datagram = recv(MAX_DATAGRAM)
            except BlockingIOError:
                if emptied_at is not None:  # empty again after the stamp: every beat before it is read
                    break
                emptied_at = clock()
                continue
            emptied_at = None
            beats += 1
            if datagram[:n] == token and len(datagram) > head:
                said[datagram[head:]] = datagram  # the latest of a drain is the one kept
        for ident, datagram in said.items():
            actor_id = names.get(ident)
            if actor_id is None:
                actor_id = names[ident] = ident.decode(errors="replace")
            if not datagram[head - 1] & last_word:  # a last word is no sign of life
                pending.heard[actor_id] = emptied_at
            body = datagram[n:head]
            if bodies.get(ident) != body:
                bodies[ident] = pending.changed[actor_id] = body
                position = b"".join([body[span] for span in spans])
                if positions.get(ident) != position:  # its training moved (or is first heard of)
                    positions[ident], pending.moved[actor_id] = position, emptied_at
        pending.drained(emptied_at, drops)
        if not unsent:  # else folded into the next frame, once the pipe took this one
            unsent, pending = _write(stdout_fd, pending.frame(longest_pause)), _Pending(pending.drops)
        wait, previous = drain_wait_s(beats, started - previous, capacity), started


def _write(fd: int, data: bytes) -> bytes:
    """As much of `data` as the pipe takes now; the rest."""
    try:
        return data[os.write(fd, data):]
    except BlockingIOError:
        return data
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # the coordinator is gone
            sys.exit(0)
        raise


def read_frame(stream) -> tuple | None:
    """The coordinator's side: the next frame from the drain process's stdout (None: it ended)."""
    head = stream.read(FRAME_HEAD.size)
    if len(head) < FRAME_HEAD.size:
        return None
    (size,) = FRAME_HEAD.unpack(head)
    body = stream.read(size)
    return pickle.loads(body) if len(body) == size else None


if __name__ == "__main__":
    run_ahead()
    config = json.loads(sys.stdin.buffer.readline())
    listener = socket.socket(fileno=int(sys.argv[1]))
    listener.setblocking(False)
    drain_forever(listener, config, sys.stdin.fileno(), sys.stdout.fileno())
