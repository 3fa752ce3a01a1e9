"""Heartbeats as UDP datagrams: each worker tells the coordinator it is alive every HEARTBEAT_EVERY_S
(job/sections.py), and the coordinator notes when it last heard of each (plan/liveness.py reads that).

Why not a Ray actor call each: on a two-core machine a Ray actor spends about 320 us of its own
CPU per call received, so 1,024 workers beating ten times a second would need three cores in the
coordinator alone. A datagram costs the coordinator one recv and a dict write (about 2 us), and a
lost datagram is just a missed beat: the timeout is several beats long.

The coordinator's side, the listener, is beat_listener.py.

A beat is the job's beat token, the worker's progress and its actor id. The token is derived from
the job's rendezvous secret (which never leaves Ray), so a datagram from outside the job is dropped;
it travels in the clear, and whoever reads it off the wire could keep a dead worker "heard". Then the
collective timeout still ends the generation, as without heartbeats.

The progress is what the worker's training thread marks on its ProgressBoard, a few bytes of shared
memory the beat process reads at each beat (no lock the training thread waits on): the generation,
the steps its engine has done, a count of marks (it moves whenever training does), the phase, and
the collectives the training group entered since the phase began (plan/stuck.py tells by them which
rank the others wait for). Once its training stood still a moment, a beat also tells how long the
worker's process has since waited for a CPU (cpu_waits.py): starved is not stuck.
When the worker's process ends, its beat process sends one last beat, flagged, with the board as the
worker left it: the coordinator learns how many steps a killed worker had done, exactly (a node that
vanishes sends nothing: its last beat is then all that is known).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import signal
import mmap
import socket
import struct
import subprocess
import sys
import tempfile
import time

from elastic_zero.wire import beat_drain

TOKEN_BYTES = 16
# after the token: generation, steps done, marks, the worker's RSS and its peak (VmHWM since its
# last reset), its node's used memory, the collectives entered since the last mark, how long its
# process waited for a CPU while its training stood still (ms: cpu_waits.StillnessMeter), phase, flags
PROGRESS = struct.Struct("<qqqqqqqqBB")
POSITION_FIELDS = (0, 1, 2, 6, 8)  # where training is: the generation, steps, marks, collectives, phase
LAST_WORD = 1  # flag: the worker's process has ended; this is the board as it left it
# what a worker's training thread does now (the board's phase, by index)
PHASES = ("starting", "entering", "data", "compute", "agree", "update", "commit", "save", "eval", "idle")
# sequence (odd while written), generation, steps done, marks, phase, the collectives entered when marked;
# then, in a slot of its own, the collectives entered so far (counted from any thread: see collective())
_BOARD = struct.Struct("<Qqqqqq")
_COUNT = struct.Struct("<q")
NO_PROGRESS = (-1, -1, 0, 0, 0)  # (generation, steps, marks, phase index, collectives since the mark)
NODE_MEMORY_EVERY_S = 0.5  # how often a beat reads its node's used memory (its worker's at every beat): node_memory.BeatMemory


def field_bytes(layout: str, fields) -> list[list[int]]:
    """The byte ranges [start, end) of the `fields` (indices) of a struct `layout` such as PROGRESS's."""
    order, codes = layout[0], layout[1:]
    return [[struct.calcsize(order + codes[:i]), struct.calcsize(order + codes[:i + 1])] for i in fields]


def beat_token(secret: bytes) -> bytes:
    return hmac.new(secret, b"elastic-zero heartbeat", hashlib.sha256).digest()[:TOKEN_BYTES]


class Progress(tuple):
    """What a beat says of its worker: (generation, steps, marks, rss, peak, node_used, collectives,
    waited_ms, phase, flags)."""

    __slots__ = ()

    def __new__(cls, generation: int = -1, steps: int = -1, marks: int = 0, rss: int = 0, peak: int = 0,
                node_used: int = 0, collectives: int = 0, waited_ms: int = 0, phase: int = 0, flags: int = 0):
        return tuple.__new__(cls, (generation, steps, marks, rss, peak, node_used, collectives, waited_ms, phase,
                                   flags))

    generation = property(lambda self: self[0])
    steps = property(lambda self: self[1])  # the steps its engine had done (-1: none yet)
    marks = property(lambda self: self[2])
    rss = property(lambda self: self[3])  # the worker's resident memory (bytes; 0: not known)
    peak = property(lambda self: self[4])  # its peak since it entered its generation (VmHWM)
    node_used = property(lambda self: self[5])  # its node's used memory, as Ray's monitor counts it
    collectives = property(lambda self: self[6])  # the training group's collectives entered since the mark
    waited_ms = property(lambda self: self[7])  # its process's wait for a CPU while its training stood still
    phase = property(lambda self: PHASES[self[8]] if self[8] < len(PHASES) else "?")
    last_word = property(lambda self: bool(self[9] & LAST_WORD))
    # where its training is: any change of it is a move (the memory figures and the waits are not)
    position = property(lambda self: tuple(self[i] for i in POSITION_FIELDS))


class ProgressBoard:
    """A worker's progress in shared memory: its training thread writes (mark), its beat process
    reads (read). A sequence lock, no mutex: a write is three small copies, and a read that met
    one is taken again."""

    def __init__(self, path: str, writable: bool) -> None:
        with open(path, "r+b" if writable else "rb") as f:
            self._mm = mmap.mmap(f.fileno(), _BOARD.size + _COUNT.size,
                                 access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self.path = path
        self._seq, self._values, self._collectives = 0, [-1, -1, 0, 0, 0], 0

    @classmethod
    def create(cls) -> "ProgressBoard":
        """A new board in a file of its own (in memory where the system has /dev/shm); the worker
        unlinks it once its beat process has mapped it (unlink())."""
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="elastic-zero-progress-", dir=where)
        os.write(fd, bytes(_BOARD.size + _COUNT.size))
        os.close(fd)
        board = cls(path, writable=True)
        board.mark(phase="starting")
        return board

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:  # gone already: nothing left to clean
            pass

    def mark(self, generation: int | None = None, steps: int | None = None, phase: str | None = None) -> None:
        """The training thread's progress: each mark counts, whatever it changes."""
        values = self._values
        if generation is not None:
            values[0] = generation
        if steps is not None:
            values[1] = steps
        values[2] += 1
        if phase is not None:
            values[3] = PHASES.index(phase)
        values[4] = self._collectives
        self._publish()

    def tick(self) -> None:
        """A sign that training moves within its phase (a micro batch, an eval batch): a mark that
        changes nothing else, and keeps the phase's count of collectives (plan/stuck.py orders by it)."""
        self._values[2] += 1
        self._publish()

    def _publish(self) -> None:
        self._seq += 1
        struct.pack_into("<Q", self._mm, 0, self._seq)  # odd: being written
        _BOARD.pack_into(self._mm, 0, self._seq, *self._values)
        self._seq += 1
        struct.pack_into("<Q", self._mm, 0, self._seq)

    def collective(self) -> None:
        """The training group enters a collective (zero/comm.py calls this, from whichever thread
        issues it: autograd's hooks too): one 8-byte store to a slot of its own, which a reader
        takes whole."""
        self._collectives += 1
        _COUNT.pack_into(self._mm, _BOARD.size, self._collectives)

    def read(self) -> tuple[int, int, int, int, int]:
        """(generation, steps, marks, phase index, collectives entered since that mark) as last marked
        whole. A writer killed inside a mark leaves it half written for ever: then the last whole
        one read before."""
        for _ in range(1000):
            first = _BOARD.unpack_from(self._mm, 0)
            if first[0] % 2 == 0 and struct.unpack_from("<Q", self._mm, 0)[0] == first[0]:
                self._read = first[1:]
                break
        generation, steps, marks, phase, at_mark = getattr(self, "_read", NO_PROGRESS)
        return generation, steps, marks, phase, max(0, _COUNT.unpack_from(self._mm, _BOARD.size)[0] - at_mark)


class HeartbeatSender:
    """A worker's side (one socket per process, whichever workers it beats for): `token` is
    beat_token() of the job's secret."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self._token, self._target = token, (host, port)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)

    def beat(self, actor_id: str, progress: tuple = NO_PROGRESS, flags: int = 0, memory: tuple = (0, 0, 0),
             waited_ms: int = 0) -> bool:
        """One beat; `progress`: (generation, steps, marks, phase index, collectives since the mark)
        from the worker's board; `memory`: (the worker's RSS, its peak, its node's used memory) in bytes;
        `waited_ms`: how long its process waited for a CPU while its training stood still (cpu_waits.py).
        Whether the kernel took it (False: it refused it; one lost beat, the next one counts)."""
        generation, steps, marks, phase, collectives = progress
        try:
            self._sock.sendto(self._token + PROGRESS.pack(generation, steps, marks, *memory, collectives, waited_ms,
                                                          phase, flags)
                              + actor_id.encode(), self._target)
            return True
        except OSError:  # the network, the coordinator gone
            return False


def start_beat_process(host: str, port: int, token: bytes, actor_id: str, every_s: float,
                       board: str | None = None) -> subprocess.Popen:
    """A worker's beats, from a process of its own (this file run as a script, standard library only).

    Why not a thread of the worker: the worker's own work stalls its threads. A thread needs the GIL,
    which a long call that holds it (unpickling a large state, a garbage collection over millions of
    objects, an extension that does not release it) keeps for seconds, and on a busy machine the
    worker's process competes for the cores: a worker stalled for a second, alive and training, was
    declared lost in CI. A process that sleeps between beats is woken on time by the kernel whatever
    its parent does. What beats then says is "this worker's process and node are alive": its death is
    Ray's to report (its pipe closes, and the beat process ends with it), and a worker hung while alive
    is found by the progress its beats carry (plan/stuck.py).

    It ignores SIGTERM and SIGINT, in a session of its own: a worker told to go by SIGTERM keeps
    beating through its grace period, while it hands its shard over. It runs ahead of its worker where
    the kernel allows it (beat_drain.run_ahead).

    Its first beat is sent before it says so on its stdout (beating_started): a worker's hello waits
    for that, because the coordinator counts a member's silence from the generation it joins. A
    worker ready last starts that generation at once, and its beat process, a Python started on a
    busy machine, could take over a second to send its first beat: that worker was declared lost,
    alive and well (seen in CI)."""
    proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    config = {"host": host, "port": port, "token": token.hex(), "actor_id": actor_id, "every_s": every_s,
              "board": board}
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
    beat_drain.run_ahead()  # a beat late looks like a vanished node: ahead of its worker where allowed
    config = json.loads(sys.stdin.buffer.readline() or b"null")
    if not config:  # the worker went before it said where to beat
        return
    sender = HeartbeatSender(config["host"], config["port"], bytes.fromhex(config["token"]))
    actor_id, every_s, stdin = config["actor_id"], config["every_s"], sys.stdin.fileno()
    board = ProgressBoard(config["board"], writable=False) if config.get("board") else None
    progress = board.read if board is not None else (lambda: NO_PROGRESS)
    worker = os.getppid()
    memory = _package_module("node_memory").BeatMemory(worker, NODE_MEMORY_EVERY_S)
    starved = _package_module("cpu_waits").StillnessMeter(worker)
    next_beat = time.monotonic()
    at = progress()
    sender.beat(actor_id, at, memory=memory(), waited_ms=starved(at))
    try:
        os.write(1, b"+")  # the first beat is out (beating_started)
        # the worker's pipe closed, and fd 1 kept taken: a file this process opens later is not its stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:  # the worker stopped listening: it goes, and this process with it (its stdin ends)
        pass
    while True:
        next_beat = max(next_beat + every_s, time.monotonic())  # late (stopped, starved): on from now
        readable, _, _ = select.select([stdin], [], [], max(0.0, next_beat - time.monotonic()))
        if readable and not os.read(stdin, 4096):  # EOF: the worker's process is gone: its last word
            sender.beat(actor_id, progress(), LAST_WORD, memory=(0, 0, memory()[2]))
            return
        at = progress()
        sender.beat(actor_id, at, memory=memory(), waited_ms=starved(at))


def _package_module(name: str):
    """The package's module `name` (standard library only), loaded by its path: the beat process runs
    this file as a script of its own, outside the package."""
    import importlib.util

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # elastic_zero/, above wire/
    spec = importlib.util.spec_from_file_location(f"elastic_zero_{name}", os.path.join(package, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":  # start_beat_process's child
    _beat_process()
