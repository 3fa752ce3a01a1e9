"""The job's rendezvous store, reachable only by those who hold the job's secret.

torch's TCPStore listens on every interface and asks nothing of a client. Here it listens on
loopback only; the coordinator's node exposes it through a relay bound to the node's cluster
address, which admits a connection only after a challenge: it sends a random nonce, and the
client must answer HMAC-SHA256(secret, nonce). A worker reaches the store through a relay of its
own on its loopback, which answers the challenge for it. The secret is made per job by the
coordinator and given to its workers through Ray (whose token auth protects it where the
cluster has it); it never touches the network in the clear.

Store traffic is small (rendezvous, a few keys per step at most), so each process copies the bytes
of all its relayed connections on one thread (SpliceLoop); a connection has a thread of its own only
while it answers the challenge.

The coordinator's side of the relay runs in a process of its own (this file run as a script: the
standard library only). In the coordinator's, its threads took the GIL from the coordinator's loop
just when that loop was busiest: after a loss at 1,024 workers every survivor opens a connection for
the next generation while the loop sends them their plans, and sampled then, a relay thread was
running in most samples beside the loop. The store itself (torch's, C++) stays in the coordinator.

The coordinator opens its store on a thread of its own: the store is torch's, and importing torch
takes a second of a two-core machine, which the coordinator spends while its workers start (they
import torch too) rather than before it spawns them. A connection that arrives first waits for it.
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
    """The coordinator's side: the store on loopback, and the relay that guards it in a process of
    its own (_relay_process), which dies with this one (it reads its stdin until EOF)."""

    def __init__(self, host: str, secret: bytes, timeout_s: float) -> None:
        self.host = host
        listener = _listener(host)
        self.port = listener.getsockname()[1]
        self._store: dist.TCPStore | None = None
        self._store_error: BaseException | None = None
        self._store_opened = threading.Event()
        # -I: isolated, nothing from the environment; the script imports the standard library only
        self._relay = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(listener.fileno())],
                                       stdin=subprocess.PIPE, pass_fds=(listener.fileno(),))
        listener.close()  # the relay holds the listening socket now
        self._relay.stdin.write(secret.hex().encode() + b"\n")
        self._relay.stdin.flush()
        threading.Thread(target=self._open_store, args=(timeout_s,), daemon=True, name="rendezvous-store").start()

    def _open_store(self, timeout_s: float) -> None:
        try:
            self._store = loopback_store(timeout_s)
        except BaseException as exc:  # noqa: BLE001 - told to whoever asks for the store
            self._store_error = exc
        finally:
            self._store_opened.set()
        try:  # the relay's connections wait for this line (0: there is no store; they are closed)
            self._relay.stdin.write(f"{self._store.port if self._store else 0}\n".encode())
            self._relay.stdin.flush()
        except (OSError, ValueError):  # closed already
            pass

    @property
    def store(self) -> dist.TCPStore:
        """The store, once open (the first caller may wait for torch's import)."""
        self._store_opened.wait()
        if self._store is None:
            raise RuntimeError(f"the rendezvous store could not be opened: {self._store_error!r}")
        return self._store

    def close(self) -> None:
        self._relay.kill()
        self._relay.wait()
        self._relay.stdin.close()


def _relay_process(listen_fd: int) -> None:
    """The relay of RendezvousServer: admits connections to its listening socket that answer the
    challenge, and splices each to the store on loopback. Its stdin brings the secret, then the
    store's port; its end (the coordinator gone) ends this process."""
    listener = socket.socket(fileno=listen_fd)
    secret = bytes.fromhex(sys.stdin.readline().strip())
    store_port: list[int] = []
    port_known = threading.Event()

    def read_stdin() -> None:
        line = sys.stdin.readline()
        store_port.append(int(line) if line.strip() else 0)
        port_known.set()
        sys.stdin.read()  # until EOF: the coordinator's process is gone
        os._exit(0)

    def admit(conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.settimeout(10.0)
            conn.sendall(nonce)
            answer = _read_exactly(conn, _DIGEST_BYTES)
            if not hmac.compare_digest(answer, hmac.new(secret, nonce, hashlib.sha256).digest()):
                conn.close()  # a client without the job's secret learns nothing, gets nothing
                return
            conn.settimeout(None)
            port_known.wait()
            if not store_port[0]:
                raise ConnectionError("the store could not be opened")
            upstream = socket.create_connection(("127.0.0.1", store_port[0]))
        except OSError:  # the client went away during the challenge, or no store: nothing to serve
            conn.close()
            return
        _splice(conn, upstream)

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


class LocalRelay:
    """A listener on this process's loopback that answers the coordinator's challenge for every
    store connection made to it: the client side of the relay, shared by every client of the process."""

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


def _answer_and_splice(conn: socket.socket, host: str, port: int, secret: bytes) -> None:
    try:
        upstream = socket.create_connection((host, port), timeout=10.0)
        nonce = _read_exactly(upstream, NONCE_BYTES)
        upstream.sendall(hmac.new(secret, nonce, hashlib.sha256).digest())
        upstream.settimeout(None)
    except OSError:  # the coordinator is unreachable: the store client sees a closed connection
        conn.close()
        return
    _splice(conn, upstream)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the rendezvous challenge")
        data += chunk
    return data


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
