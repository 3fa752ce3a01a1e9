"""The job's key-value store, served in Python with the wire protocol of torch's TCPStore, so that
the coordinator never imports torch (0.9 s of CPU and 180 MB per job, measured here) and the store
lives in the relay's process, which already guards every connection to it (rendezvous.py).

Workers stay torch's own TCPStore clients: process groups (gloo, NCCL) take a torch Store. The
protocol is torch's libuv server's (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp, the
default server since torch 2.4): a command byte, then fields, native byte order (little-endian on
every platform torch ships for); a key or a value is a u64 length and its bytes. A connection's
first command is VALIDATE with torch's magic number. A value that ADD counts is its decimal text.

The standard library only: the relay runs this file's code with `python -I` (loaded by path).
KeyValueState is the store's pure semantics (tested against torch's own server); parse_command
cuts a command from a connection's bytes; StoreServer serves connections on one thread.
"""

from __future__ import annotations

import queue
import selectors
import socket
import struct
import threading
from collections import deque


def read_exactly(sock: socket.socket, n: int, closed: str = "closed during the rendezvous challenge") -> bytes:
    """`n` bytes from a blocking `sock`; ConnectionError(`closed`) if it closes first (a store
    client's and the relay's challenge read both)."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(closed)
        data += chunk
    return bytes(data)


VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, \
    CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER = range(19)
VALIDATION_MAGIC = 0x3C85F7CE
READY, NOT_READY = 0, 1  # CHECK's answers
STOP_WAITING, WAIT_CANCELED = 0, 1  # WAIT's (and BARRIER's, CANCEL_WAIT's)
MAX_KEYS = 128 * 1024  # in one CHECK, WAIT, MULTI_GET or MULTI_SET, as torch's server allows
MAX_BYTES = 1 << 30  # of one key or value

U8, U32, U64, I64 = struct.Struct("=B"), struct.Struct("=I"), struct.Struct("=Q"), struct.Struct("=q")


class ProtocolError(ValueError):
    """A client sent what torch's server would refuse: the connection is closed."""


def vector(data: bytes) -> bytes:
    return U64.pack(len(data)) + data


class KeyValueState:
    """The store's state and semantics, as torch's server has them; no sockets. A client is any
    hashable. Each call returns the reply to the caller (or None: no reply now) and the replies that
    other, waiting, clients get now: [(client, bytes)]."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.queues: dict[str, deque] = {}
        self._waiting: dict[str, list] = {}  # key -> clients waiting for it
        self._awaited: dict = {}  # client -> how many of its keys are still missing

    def set(self, key: str, value: bytes) -> list:
        self.values[key] = value
        return self._wake(key)

    def compare_set(self, key: str, expected: bytes, new: bytes) -> tuple[bytes, list]:
        current = self.values.get(key)
        if current is None:
            if expected:  # torch's answer: the expected value, and nothing set
                return vector(expected), self._wake(key)
            self.values[key] = new
            return vector(new), self._wake(key)
        if current == expected:
            self.values[key] = current = new
        return vector(current), self._wake(key)

    def get(self, key: str) -> bytes:
        return vector(self.values.get(key, b""))

    def add(self, key: str, amount: int) -> tuple[bytes, list]:
        total = amount + (int(self.values[key]) if key in self.values else 0)
        self.values[key] = str(total).encode()
        return I64.pack(total), self._wake(key)

    def check(self, keys: list[str]) -> bytes:
        return U8.pack(READY if self._present(keys) else NOT_READY)

    def wait(self, client, keys: list[str]) -> bytes | None:
        if self._present(keys):
            return U8.pack(STOP_WAITING)
        missing = [k for k in keys if k not in self.values]
        for key in missing:
            self._waiting.setdefault(key, []).append(client)
        self._awaited[client] = len(missing)
        return None

    def cancel_wait(self, client) -> bytes:
        self.forget(client)
        return U8.pack(WAIT_CANCELED)

    def delete(self, key: str) -> bytes:
        return I64.pack(1 if self.values.pop(key, None) is not None else 0)

    def append(self, key: str, value: bytes) -> list:
        self.values[key] = self.values.get(key, b"") + value
        return self._wake(key)

    def queue_push(self, key: str, value: bytes) -> list:
        self.queues.setdefault(key, deque()).append(value)
        for client in self._waiting.get(key, []):  # one waiter: one value to pop
            self._awaited[client] -= 1
            if self._awaited[client] == 0:
                self._waiting[key].remove(client)
                del self._awaited[client]
                return [(client, U8.pack(STOP_WAITING))]
        return []

    def queue_pop(self, key: str) -> bytes:
        values = self.queues.setdefault(key, deque())
        return I64.pack(len(values)) + (vector(values.popleft()) if values else b"")

    def queue_len(self, key: str) -> bytes:
        return I64.pack(len(self.queues.get(key, ())))

    def list_keys(self) -> bytes:
        return I64.pack(len(self.values)) + b"".join(vector(k.encode()) for k in self.values)

    def barrier(self, client, key: str, world_size: int) -> tuple[bytes | None, list]:
        count = 1 + (int(self.values[key]) if key in self.values else 0)
        self.values[key] = str(count).encode()
        if count >= world_size:
            return U8.pack(STOP_WAITING), self._wake(key)
        self._waiting.setdefault(key, []).append(client)
        self._awaited[client] = 1
        return None, []

    def forget(self, client) -> None:
        """A client's waits are cancelled, or it is gone."""
        if self._awaited.pop(client, None) is None:
            return
        for key in [k for k, clients in self._waiting.items() if client in clients]:
            self._waiting[key] = [c for c in self._waiting[key] if c != client]
            if not self._waiting[key]:
                del self._waiting[key]

    def _present(self, keys: list[str]) -> bool:
        return all(k in self.values or self.queues.get(k) for k in keys)

    def _wake(self, key: str) -> list:
        woken = []
        for client in self._waiting.pop(key, []):
            if client in self._awaited:
                self._awaited[client] -= 1
                if self._awaited[client] == 0:
                    del self._awaited[client]
                    woken.append((client, U8.pack(STOP_WAITING)))
        return woken


class _Reader:
    """Reads fields from a buffer; IndexError when the command is not all there yet."""

    def __init__(self, data: bytearray) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise IndexError
        self.at += n
        return bytes(self.data[self.at - n:self.at])

    def value(self, kind: struct.Struct) -> int:
        return kind.unpack(self.take(kind.size))[0]

    def blob(self) -> bytes:
        size = self.value(U64)
        if size > MAX_BYTES:
            raise ProtocolError(f"a key or value of {size} bytes (at most {MAX_BYTES})")
        return self.take(size)

    def key(self) -> str:
        return self.blob().decode("utf-8", errors="surrogateescape")

    def count(self) -> int:
        n = self.value(U64)
        if n > MAX_KEYS:
            raise ProtocolError(f"{n} keys in one command (at most {MAX_KEYS})")
        return n


def parse_command(data: bytearray) -> tuple[tuple, int] | None:
    """The first whole command in `data` and how many bytes it took, or None if it is not all there."""
    r = _Reader(data)
    try:
        command = r.value(U8)
        if command == VALIDATE:
            args: tuple = (r.value(U32),)
        elif command == PING:
            args = (r.value(U32),)
        elif command in (SET, APPEND, QUEUE_PUSH):
            args = (r.key(), r.blob())
        elif command == COMPARE_SET:
            args = (r.key(), r.blob(), r.blob())
        elif command in (GET, DELETE_KEY, QUEUE_POP, QUEUE_LEN):
            args = (r.key(),)
        elif command == ADD:
            args = (r.key(), r.value(I64))
        elif command in (CHECK, WAIT, MULTI_GET):
            args = tuple(r.key() for _ in range(r.count()))
        elif command == MULTI_SET:
            args = tuple((r.key(), r.blob()) for _ in range(r.count()))
        elif command in (GETNUMKEYS, CANCEL_WAIT, LIST_KEYS):
            args = ()
        elif command == BARRIER:
            args = (r.key(), r.value(I64))
        else:
            raise ProtocolError(f"unknown command {command}")
    except IndexError:
        return None
    return (command, *args), r.at


def apply(state: KeyValueState, client, command: tuple) -> tuple[bytes | None, list]:
    """A parsed command (not VALIDATE) carried out: (the reply to `client` or None, other replies)."""
    kind, args = command[0], command[1:]
    if kind == PING:
        return U32.pack(args[0]), []
    if kind == SET:
        return None, state.set(*args)
    if kind == COMPARE_SET:
        return state.compare_set(*args)
    if kind == GET:
        return state.get(args[0]), []
    if kind == ADD:
        return state.add(*args)
    if kind == CHECK:
        return state.check(list(args)), []
    if kind == WAIT:
        return state.wait(client, list(args)), []
    if kind == GETNUMKEYS:
        return I64.pack(len(state.values)), []
    if kind == DELETE_KEY:
        return state.delete(args[0]), []
    if kind == APPEND:
        return None, state.append(*args)
    if kind == MULTI_GET:
        return b"".join(state.get(k) for k in args), []
    if kind == MULTI_SET:
        return None, [w for key, value in args for w in state.set(key, value)]
    if kind == CANCEL_WAIT:
        return state.cancel_wait(client), []
    if kind == QUEUE_PUSH:
        return None, state.queue_push(*args)
    if kind == QUEUE_POP:
        return state.queue_pop(args[0]), []
    if kind == QUEUE_LEN:
        return state.queue_len(args[0]), []
    if kind == LIST_KEYS:
        return state.list_keys(), []
    if kind == BARRIER:
        return state.barrier(client, *args)
    raise ProtocolError(f"unknown command {kind}")


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.inbox, self.outbox, self.validated = sock, bytearray(), bytearray(), False


class StoreServer:
    """Serves the store to connections handed to it by add() (the relay's, once admitted), all on one
    thread, non-blocking: a client that reads nothing (a frozen machine) only grows its own outbox."""

    def __init__(self) -> None:
        self.state = KeyValueState()
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        threading.Thread(target=self._run, daemon=True, name="store").start()

    def add(self, sock: socket.socket) -> None:
        self._pending.put(sock)
        self._waker.send(b"\0")

    def _run(self) -> None:
        while True:
            for key, events in self._selector.select():
                if key.data is None:
                    self._take_new()
                    continue
                connection = key.data
                if events & selectors.EVENT_READ:
                    self._read(connection)
                if events & selectors.EVENT_WRITE and connection.sock.fileno() >= 0:
                    self._flush(connection)

    def _take_new(self) -> None:
        try:
            self._wake.recv(4096)
        except BlockingIOError:
            pass
        while not self._pending.empty():
            sock = self._pending.get()
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _read(self, connection: _Connection) -> None:
        try:
            chunk = connection.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(connection)
            return
        connection.inbox += chunk
        try:
            while connection.sock.fileno() >= 0:  # (a failed send closes it)
                parsed = parse_command(connection.inbox)
                if parsed is None:
                    break
                command, used = parsed
                del connection.inbox[:used]
                if not connection.validated:  # torch's server: the first command validates the client
                    if command != (VALIDATE, VALIDATION_MAGIC):
                        raise ProtocolError(f"the first command was not torch's validation: {command[:1]}")
                    connection.validated = True
                    continue
                reply, woken = apply(self.state, connection, command)
                if reply is not None:
                    self._send(connection, reply)
                for other, data in woken:
                    self._send(other, data)
        except ProtocolError:
            self._close(connection)

    def _send(self, connection: _Connection, data: bytes) -> None:
        if connection.sock.fileno() < 0:
            return
        connection.outbox += data
        self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.outbox)
            del connection.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError:
            self._close(connection)
            return
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.outbox else 0)
        if self._selector.get_key(connection.sock).events != wanted:
            self._selector.modify(connection.sock, wanted, connection)

    def _close(self, connection: _Connection) -> None:
        self.state.forget(connection)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

