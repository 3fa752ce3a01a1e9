"""The job's rendezvous store, reachable only by those who hold the job's secret.

The store is served by the coordinator's relay, a process of its own (this file run as a script:
the standard library only), in Python with torch's TCPStore protocol (store_server.py), so that the
coordinator never imports torch. The relay listens on the node's cluster address and admits a
connection only after a challenge: it sends a random nonce, and the client must answer
HMAC-SHA256(secret, nonce). A worker reaches the store through a relay of its own on its loopback,
which answers the challenge for it; its client is torch's own TCPStore, which its process groups
take. The secret is made per job by the coordinator and given to its workers through Ray (whose
token auth protects it where the cluster has it); it never touches the network in the clear.

Why a process of its own: in the coordinator's, the relay's threads took the GIL from the
coordinator's loop just when that loop was busiest (after a loss at 1,024 workers every survivor
opens a connection for the next generation while the loop sends them their plans). Why not torch's
TCPStore server: with it, a job's coordinator took 1.43 s of CPU and peaked at 312 MB in a 100-step
gpt-tiny job here; without torch, 0.54 s and 132 MB (the CPU on a two-core machine, while its workers
import torch too).

A worker's store traffic is small (rendezvous, a few keys per step at most), so each worker process
copies the bytes of all its relayed connections on one thread (SpliceLoop); a connection has a
thread of its own only while it answers the challenge.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import hmac
import os
import queue
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

    from elastic_zero.wire.store_client import StoreClient

NONCE_BYTES = 16
SEND_TIMEOUT_S = 10.0
_DIGEST_BYTES = hashlib.sha256().digest_size


def new_secret() -> bytes:
    return os.urandom(32)


def _listener(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(socket.SOMAXCONN)  # a thousand workers may connect at once: a full backlog drops SYNs (1-3 s each)
    return sock


def loopback_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only (torch's own would listen everywhere)."""
    import torch.distributed as dist

    sock = _listener("127.0.0.1")
    # torch takes the descriptor over; the socket object must not close it behind torch's back
    fd = sock.detach()
    return dist.TCPStore("127.0.0.1", _port_of(fd), None, True, wait_for_workers=False, master_listen_fd=fd,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _port_of(fd: int) -> int:
    probe = socket.socket(fileno=os.dup(fd))
    try:
        return probe.getsockname()[1]
    finally:
        probe.close()


class RendezvousServer:
    """The coordinator's side: the relay, in a process of its own (_relay_process), that guards the
    store and serves it (store_server.py); it dies with this process (it reads its stdin until EOF).
    `store` is this process's own connection to it, admitted as any other."""

    def __init__(self, host: str, secret: bytes, timeout_s: float) -> None:
        self.host, self._secret, self._timeout_s = host, secret, timeout_s
        listener = _listener(host)
        self.port = listener.getsockname()[1]
        # -I: isolated, nothing from the environment; the script imports the standard library only. The
        # relay is not this process's child (_relay_process): Ray ends an actor's children before the
        # actor itself (ray.kill, its memory monitor), and a coordinator that saw its store go first
        # failed the job and retired the workers its replacement was to take over (the chaos drill).
        launcher = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(listener.fileno()),
                                     str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    pass_fds=(listener.fileno(),))
        listener.close()  # the relay holds the listening socket now
        said = launcher.stdout.readline()
        launcher.stdout.close()
        launcher.wait()  # (it ended as it forked the relay)
        if not said.strip().isdigit():
            launcher.stdin.close()
            raise RuntimeError(f"the job's store relay did not start (its launcher exited {launcher.returncode}; "
                               f"the relay's own error, if any, is in this process's stderr)")
        self.relay_pid = int(said)
        self._relay_stdin = launcher.stdin  # the relay's stdin: it ends at its EOF, this process gone or close()
        self._relay_stdin.write(secret.hex().encode() + b"\n")
        self._relay_stdin.flush()
        self._store: StoreClient | None = None
        self._store_lock = threading.Lock()

    @property
    def store(self) -> StoreClient:
        """This process's connection to the store, made on first use."""
        from elastic_zero.wire.store_client import StoreClient

        with self._store_lock:
            if self._store is None:
                sock = admitted_connection(self.host, self.port, self._secret, self._timeout_s)
                self._store = StoreClient(sock, self._timeout_s)
            return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._relay_stdin.close()  # its EOF: the relay ends (no kill by pid: not this process's child to reap)


def _relay_process(listen_fd: int) -> None:
    """The relay of RendezvousServer: admits connections to its listening socket that answer the
    challenge, and serves the store to them. Its stdin brings the secret; its end (the coordinator
    gone) ends this process. It makes itself nobody's child first (its launcher forks it and ends),
    in a session of its own: the coordinator's end, not Ray's cleanup of the coordinator's children
    or process group, ends it. Its pid is the one line it writes; its command line's last argument, its
    owner's pid, is there for whoever looks for it (bench control-plane). Ended, it is reaped by the
    node's init (in a container whose PID 1 reaps nothing, it stays a zombie: an entry, no memory)."""
    if os.fork():
        os._exit(0)
    os.setsid()
    os.write(1, f"{os.getpid()}\n".encode())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the launcher's reader sees EOF; a stray print goes nowhere
    os.close(devnull)
    listener = socket.socket(fileno=listen_fd)
    secret = bytes.fromhex(sys.stdin.readline().strip())
    store_server = _store_server_module()
    server, read_exactly = store_server.StoreServer(), store_server.read_exactly

    def read_stdin() -> None:
        sys.stdin.read()  # until EOF: the coordinator's process is gone
        os._exit(0)

    def admit(conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.settimeout(10.0)
            conn.sendall(nonce)
            answer = read_exactly(conn, _DIGEST_BYTES)
        except OSError:  # the client went away during the challenge
            conn.close()
            return
        if not hmac.compare_digest(answer, hmac.new(secret, nonce, hashlib.sha256).digest()):
            conn.close()  # a client without the job's secret learns nothing, gets nothing
            return
        server.add(conn)

    threading.Thread(target=read_stdin, daemon=True, name="coordinator-pipe").start()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as exc:  # out of descriptors for a moment (thousands of connections): wait, not die
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            time.sleep(0.1)
            continue
        threading.Thread(target=admit, args=(conn,), daemon=True).start()


def _store_server_module():
    """store_server.py, loaded by its path: this file runs as a script (`python -I`), where the
    package cannot be imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "elastic_zero_store_server", os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LocalRelay:
    """A listener on this process's loopback that answers the coordinator's challenge for every
    store connection made to it: the client side of the relay, shared by every client of the process.
    Its bytes are copied on a Python thread: a torch client call that holds the GIL while it waits
    for its answer (in torch 2.13, queue_len, queue_pop and list_keys) would wait forever; none of
    the job's uses makes one."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._target, self._secret = (host, port), secret
        self._listener = _listener("127.0.0.1")
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="rendezvous-client-relay").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listening socket was closed: the worker is going away
                return
            threading.Thread(target=_answer_and_splice, args=(conn, *self._target, self._secret), daemon=True).start()

    def client(self, timeout_s: float) -> dist.TCPStore:
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def connect(host: str, port: int, secret: bytes, timeout_s: float) -> dist.TCPStore:
    """A TCPStore client of the job's store at (host, port), through a local relay that answers
    the coordinator's challenge with `secret`."""
    return LocalRelay(host, port, secret).client(timeout_s)


def admitted_connection(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """A connection to the coordinator's relay at (host, port) that answered its challenge with
    `secret` (its timeout left at `timeout_s`); OSError if the relay is unreachable or hangs up."""
    from elastic_zero.wire.store_server import read_exactly  # here: as a script, this file imports no package

    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        nonce = read_exactly(sock, NONCE_BYTES)
        sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest())
    except OSError:
        sock.close()
        raise
    return sock


def _answer_and_splice(conn: socket.socket, host: str, port: int, secret: bytes) -> None:
    try:
        upstream = admitted_connection(host, port, secret, 10.0)
        upstream.settimeout(None)
    except OSError:  # the coordinator is unreachable: the store client sees a closed connection
        conn.close()
        return
    _splice(conn, upstream)


class SpliceLoop:
    """Copies bytes both ways between pairs of sockets until either side closes, every pair of the
    process on one thread: a thread per direction would make the coordinator of 1,024 workers run
    thousands of threads (a store connection per worker, and one per process group it builds)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        threading.Thread(target=self._run, daemon=True, name="rendezvous-splices").start()

    def add(self, a: socket.socket, b: socket.socket) -> None:
        self._pending.put((a, b))
        self._waker.send(b"\0")

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    self._take_new()
                else:
                    self._pump(key.fileobj, key.data)

    def _take_new(self) -> None:
        try:
            self._wake.recv(4096)
        except BlockingIOError:
            pass
        while not self._pending.empty():
            a, b = self._pending.get()
            for sock in (a, b):
                # a read is only made when select says there is data; a send to a peer that reads
                # nothing (a frozen machine, a full buffer) gives up after this and ends the pair
                sock.settimeout(SEND_TIMEOUT_S)
            self._selector.register(a, selectors.EVENT_READ, b)
            self._selector.register(b, selectors.EVENT_READ, a)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            chunk = src.recv(65536)
            if chunk:
                dst.sendall(chunk)
                return
        except OSError:  # either end reset, or the peer read nothing for SEND_TIMEOUT_S
            pass
        for sock in (src, dst):  # one side closed: the copy in the other direction ends with it
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):  # already unregistered with its peer
                pass
            sock.close()


_splice_loop: SpliceLoop | None = None
_splice_loop_lock = threading.Lock()


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes (on the process's splice loop)."""
    global _splice_loop
    with _splice_loop_lock:
        if _splice_loop is None:
            _splice_loop = SpliceLoop()
    _splice_loop.add(a, b)


if __name__ == "__main__":  # RendezvousServer's relay
    _relay_process(int(sys.argv[1]))
