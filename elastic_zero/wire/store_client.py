"""The coordinator's own connection to the job's store (store_server.py serves it in the relay's
process): the calls the coordinator makes, in torch's TCPStore protocol, without torch."""

from __future__ import annotations

import socket
import struct
import threading

from elastic_zero.wire.store_server import (CHECK, COMPARE_SET, GET, I64, PING, QUEUE_LEN, QUEUE_POP, READY, SET,
                                            STOP_WAITING, U8, U32, U64, VALIDATE, VALIDATION_MAGIC, WAIT,
                                            read_exactly, vector)


class StoreClient:
    """The coordinator's connection to the store (torch's client protocol, the calls it makes), on a
    socket already admitted by the relay. Thread-safe: one call at a time. Keys go as torch's client
    sends them, under "/", so that both name the same key."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock, self._lock = sock, threading.Lock()
        sock.settimeout(timeout_s)
        with self._lock:
            sock.sendall(U8.pack(VALIDATE) + U32.pack(VALIDATION_MAGIC) + U8.pack(PING) + U32.pack(7))
            if self._value(U32) != 7:
                raise ConnectionError("the store did not answer its ping")

    def set(self, key: str, value: bytes | str) -> None:
        with self._lock:
            self._sock.sendall(U8.pack(SET) + _key(key) + vector(_bytes(value)))

    def compare_set(self, key: str, expected: bytes | str, new: bytes | str) -> bytes:
        with self._lock:
            self._sock.sendall(U8.pack(COMPARE_SET) + _key(key) + vector(_bytes(expected))
                               + vector(_bytes(new)))
            return self._blob()

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            self._sock.sendall(U8.pack(CHECK) + U64.pack(len(keys)) + b"".join(_key(k) for k in keys))
            return self._value(U8) == READY

    def get(self, key: str) -> bytes:
        """The key's value, once set (as torch's get: it waits, up to the client's timeout, after which
        this connection is out of step and unusable: the coordinator gets only keys it checked)."""
        with self._lock:
            self._sock.sendall(U8.pack(WAIT) + U64.pack(1) + _key(key) + U8.pack(GET) + _key(key))
            if self._value(U8) != STOP_WAITING:
                raise ConnectionError(f"the store's wait for {key!r} ended without the key")
            return self._blob()

    def pop_all(self, key: str) -> list[bytes]:
        """Every value in the queue `key` (torch's queue_push), taken out in order: its length, then
        that many pops sent at once and answered in turn (two exchanges, however many values)."""
        with self._lock:
            self._sock.sendall(U8.pack(QUEUE_LEN) + _key(key))
            count = self._value(I64)
            if count <= 0:
                return []
            self._sock.sendall((U8.pack(QUEUE_POP) + _key(key)) * count)
            values = []
            for _ in range(count):
                if self._value(I64) > 0:  # the queue's length before the pop: 0, nothing popped
                    values.append(self._blob())
            return values

    def close(self) -> None:
        self._sock.close()

    def _value(self, kind: struct.Struct) -> int:
        return kind.unpack(self._exactly(kind.size))[0]

    def _blob(self) -> bytes:
        return self._exactly(self._value(U64))

    def _exactly(self, n: int) -> bytes:
        return read_exactly(self._sock, n, "the store closed the connection")


def _key(key: str) -> bytes:
    return vector(("/" + key).encode())


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
