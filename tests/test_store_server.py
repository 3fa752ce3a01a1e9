"""The job's store served in Python (store_server.py) with torch's TCPStore protocol. Oracles: torch's
own server, given the same commands by the same torch client; a gloo process group formed over it;
torch's server's source for what no torch client of ours sends (queues, barriers)."""

import datetime
import random
import threading

import pytest
import torch
import torch.distributed as dist

from elastic_zero.wire.rendezvous import RendezvousServer, admitted_connection, connect, loopback_store, new_secret
from elastic_zero.wire.store_server import (NOT_READY, READY, STOP_WAITING, WAIT_CANCELED, KeyValueState,
                                            parse_command, vector)

pytestmark = pytest.mark.unit
TIMEOUT = datetime.timedelta(seconds=10)


def _session(store, rng: random.Random) -> list:
    """The same seeded commands, each with what the store answered."""
    said, known = [], []
    for _ in range(300):
        op = rng.choice(["set", "get", "add", "check", "compare_set", "delete", "append", "multi", "num_keys"])
        key = f"k{rng.randrange(12)}"
        if op == "set":
            said.append((op, store.set(key, bytes([rng.randrange(256)]) * rng.randrange(3))))
            known.append(key)
        elif op == "get" and known:
            key = rng.choice(known)
            said.append((op, store.check([key]) and store.get(key)))
        elif op == "add":
            counter = f"n{rng.randrange(3)}"
            said.append((op, store.add(counter, rng.randrange(-5, 6))))
        elif op == "check":
            said.append((op, store.check([key, f"k{rng.randrange(12)}"])))
        elif op == "compare_set":
            expected = rng.choice([b"", b"\x00", bytes([rng.randrange(256)])])
            said.append((op, store.compare_set(key, expected, b"new")))
        elif op == "delete":
            said.append((op, store.delete_key(key)))
            known = [k for k in known if k != key]
        elif op == "append":
            store.append(key, b"+")
            known.append(key)
        elif op == "multi":
            keys = [f"m{i}" for i in range(rng.randrange(1, 4))]
            store.multi_set(keys, [k.encode() for k in keys])
            said.append((op, store.multi_get(keys)))
        elif op == "num_keys":
            said.append((op, store.num_keys()))
    return said


def test_torchs_client_gets_from_our_store_what_torchs_own_server_answers():
    secret = new_secret()
    ours = RendezvousServer("127.0.0.1", secret, 10)
    theirs = loopback_store(10)
    try:
        client_of_theirs = dist.TCPStore("127.0.0.1", theirs.port, None, False, timeout=TIMEOUT)
        for seed in range(3):
            if seed:  # each session starts from an empty store on both sides
                ours.close()
                ours = RendezvousServer("127.0.0.1", secret, 10)
                theirs = loopback_store(10)
                client_of_theirs = dist.TCPStore("127.0.0.1", theirs.port, None, False, timeout=TIMEOUT)
            expected = _session(client_of_theirs, random.Random(seed))
            assert _session(connect("127.0.0.1", ours.port, secret, 10), random.Random(seed)) == expected
    finally:
        ours.close()


def test_a_gloo_group_forms_and_reduces_over_our_store_and_a_timed_out_wait_leaves_it_usable():
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, 10)
    sums, errors = {}, []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("g0", connect("127.0.0.1", server.port, secret, 10)),
                                          r, 3, TIMEOUT)
            tensor = torch.full((4,), float(r + 1))
            group.allreduce([tensor]).wait()
            sums[r] = tensor.tolist()
        except Exception as exc:  # noqa: BLE001 - shown by the assertion below
            errors.append(exc)

    try:
        ranks = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(30)
        assert not errors and sums == {r: [6.0] * 4 for r in range(3)}
        client = connect("127.0.0.1", server.port, secret, 10)
        with pytest.raises(dist.DistStoreError):  # the client cancels its wait (CANCEL_WAIT), then goes on
            client.wait(["never"], datetime.timedelta(seconds=0.3))
        client.set("after", "yes")
        assert client.get("after") == b"yes"
    finally:
        server.close()


def test_the_coordinators_client_and_torchs_clients_name_the_same_keys():
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, 10)
    try:
        worker = connect("127.0.0.1", server.port, secret, 10)
        server.store.set("from-coordinator", b"1")
        assert worker.get("from-coordinator") == b"1"
        worker.set("from-worker", "2")
        assert server.store.check(["from-worker"]) and not server.store.check(["from-worker", "missing"])
        assert server.store.get("from-worker") == b"2"
        # generation_ends.py: "ended" only where no abort was said
        assert server.store.compare_set("g1/over", "", "ended") == b"ended"
        server.store.set("g2/over", "abort")
        assert server.store.compare_set("g2/over", "", "ended") == b"abort" and worker.get("g2/over") == b"abort"
    finally:
        server.close()


@pytest.mark.parametrize("first", [bytes([1]) + vector(b"/k") + vector(b"v"),  # no validation first
                                   bytes([0]) + (0x3C85F7CE).to_bytes(4, "little") + bytes([200])])  # unknown
def test_a_client_that_breaks_the_protocol_is_dropped_alone(first):
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, 10)
    try:
        good = connect("127.0.0.1", server.port, secret, 10)
        bad = admitted_connection("127.0.0.1", server.port, secret, 5)
        bad.sendall(first)
        assert bad.recv(16) == b""  # closed
        good.set("still", "served")
        assert good.get("still") == b"served" and not server.store.check(["k"])
    finally:
        server.close()


def test_a_command_is_cut_only_once_all_of_it_came():
    whole = bytes([2]) + vector(b"/key") + vector(b"old") + vector(b"new") + bytes([7])
    for cut in range(len(whole) - 1):
        assert parse_command(bytearray(whole[:cut])) is None
    command, used = parse_command(bytearray(whole))
    assert command == (2, "/key", b"old", b"new") and used == len(whole) - 1


def test_waits_barriers_and_queues_as_torchs_server_keeps_them():
    """What torch's server does (TCPStoreLibUvBackend.cpp), where no torch client of ours can show it."""
    state = KeyValueState()
    assert state.wait("a", ["x", "y"]) is None and state.wait("b", ["y"]) is None
    assert state.set("y", b"1") == [("b", bytes([STOP_WAITING]))]  # a still waits for x
    assert state.set("x", b"1") == [("a", bytes([STOP_WAITING]))]
    assert state.wait("a", ["x"]) == bytes([STOP_WAITING])  # there already
    assert state.check(["x", "z"]) == bytes([NOT_READY]) and state.check(["x"]) == bytes([READY])
    assert state.wait("c", ["z"]) is None and state.cancel_wait("c") == bytes([WAIT_CANCELED])
    assert state.set("z", b"") == []  # c no longer waits
    # a barrier of 3: the third to come releases the two waiting
    assert state.barrier("p", "bar", 3) == (None, []) and state.barrier("q", "bar", 3) == (None, [])
    reply, woken = state.barrier("r", "bar", 3)
    assert reply == bytes([STOP_WAITING]) and sorted(c for c, _ in woken) == ["p", "q"]
    # a queue's push wakes one waiter; a pop answers the length before it, then the value
    assert state.wait("u", ["jobs"]) is None and state.wait("v", ["jobs"]) is None
    assert state.queue_push("jobs", b"one") == [("u", bytes([STOP_WAITING]))]
    assert state.queue_len("jobs") == (1).to_bytes(8, "little")
    assert state.queue_pop("jobs") == (1).to_bytes(8, "little") + vector(b"one")
    assert state.queue_pop("jobs") == (0).to_bytes(8, "little")
    state.forget("v")  # its connection closed
    assert state.queue_push("jobs", b"two") == []
