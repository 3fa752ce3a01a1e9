"""The job's rendezvous store, reachable only by those who hold the job's secret.

torch's TCPStore listens on every interface and asks nothing of a client. Here it listens on
loopback only; the coordinator's node exposes it through a relay bound to the node's cluster
address, which admits a connection only after a challenge: it sends a random nonce, and the
client must answer HMAC-SHA256(secret, nonce). A worker reaches the store through a relay of its
own on its loopback, which answers the challenge for it. The secret is made per job by the
coordinator and given to its workers through Ray (whose token auth protects it where the
cluster has it); it never touches the network in the clear.

Store traffic is small (rendezvous, a few keys per step at most), so the relays are plain
threads copying bytes.

The coordinator opens its store on a thread of its own: the store is torch's, and importing torch
takes a second of a two-core machine, which the coordinator spends while its workers start (they
import torch too) rather than before it spawns them. A connection that arrives first waits for it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

NONCE_BYTES = 16
_DIGEST_BYTES = hashlib.sha256().digest_size


def new_secret() -> bytes:
    return os.urandom(32)


def _listener(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
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
    """The coordinator's side: the store on loopback and the relay that guards it."""

    def __init__(self, host: str, secret: bytes, timeout_s: float) -> None:
        self.host, self._secret = host, secret
        self._sock = _listener(host)
        self.port = self._sock.getsockname()[1]
        self._store: dist.TCPStore | None = None
        self._store_error: BaseException | None = None
        self._store_opened = threading.Event()
        threading.Thread(target=self._open_store, args=(timeout_s,), daemon=True, name="rendezvous-store").start()
        threading.Thread(target=self._serve, daemon=True, name="rendezvous-relay").start()

    def _open_store(self, timeout_s: float) -> None:
        try:
            self._store = loopback_store(timeout_s)
        except BaseException as exc:  # noqa: BLE001 - told to whoever asks for the store
            self._store_error = exc
        finally:
            self._store_opened.set()

    @property
    def store(self) -> dist.TCPStore:
        """The store, once open (the first caller may wait for torch's import)."""
        self._store_opened.wait()
        if self._store is None:
            raise RuntimeError(f"the rendezvous store could not be opened: {self._store_error!r}")
        return self._store

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the listening socket was closed: the job is over
                return
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.settimeout(10.0)
            conn.sendall(nonce)
            answer = _read_exactly(conn, _DIGEST_BYTES)
            if not hmac.compare_digest(answer, hmac.new(self._secret, nonce, hashlib.sha256).digest()):
                conn.close()  # a client without the job's secret learns nothing, gets nothing
                return
            conn.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.store.port))
        except (OSError, RuntimeError):  # the client went away during the challenge, or no store: nothing to serve
            conn.close()
            return
        _splice(conn, upstream)

    def close(self) -> None:
        self._sock.close()


def connect(host: str, port: int, secret: bytes, timeout_s: float) -> dist.TCPStore:
    """A TCPStore client of the job's store at (host, port), through a local relay that answers
    the coordinator's challenge with `secret`."""
    import torch.distributed as dist

    local = _listener("127.0.0.1")

    def serve() -> None:
        while True:
            try:
                conn, _ = local.accept()
            except OSError:  # the listening socket was closed: the worker is going away
                return
            threading.Thread(target=_answer_and_splice, args=(conn, host, port, secret), daemon=True).start()

    threading.Thread(target=serve, daemon=True, name="rendezvous-client-relay").start()
    return dist.TCPStore("127.0.0.1", local.getsockname()[1], None, False,
                         timeout=datetime.timedelta(seconds=timeout_s))


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


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:  # either end reset: the copy in the other direction ends with it
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:  # already shut down by the other pump
                    pass

    threading.Thread(target=pump, args=(b, a), daemon=True).start()
    pump(a, b)
    a.close()
    b.close()
