"""The job's rendezvous store, served by the coordinator's relay to holders of
the job's secret. Oracle: what a client with and without the secret can do."""

import datetime
import socket

import pytest
import torch.distributed as dist

from elastic_zero.wire.rendezvous import RendezvousServer, connect, loopback_store, new_secret

pytestmark = pytest.mark.unit


def _other_address():
    """An address of this machine other than loopback, if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_holders_of_the_secret_share_the_store():
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, 10)
    a, b = connect("127.0.0.1", server.port, secret, 10), connect("127.0.0.1", server.port, secret, 10)
    a.set("g0/key", "value")
    assert b.get("g0/key") == b"value" and server.store.get("g0/key") == b"value"
    assert [a.add("n", 1), b.add("n", 1)] == [1, 2]
    server.close()


@pytest.mark.parametrize("secret", [None, b"not the job's secret"])
def test_a_client_without_the_secret_gets_nothing(secret):
    server = RendezvousServer("127.0.0.1", new_secret(), 10)
    server.store.set("g0/key", "value")
    with pytest.raises(dist.DistNetworkError):
        if secret is None:  # a plain TCPStore client, as any process on the network could make
            dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=2)).get("g0/key")
        else:
            connect("127.0.0.1", server.port, secret, 2).get("g0/key")
    server.close()


def test_the_store_itself_listens_on_loopback_only():
    """torch's TCPStore server listens on every interface; ours is bound to 127.0.0.1."""
    store = loopback_store(10)
    address = _other_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    with pytest.raises(OSError):
        socket.create_connection((address, store.port), timeout=2).close()
    socket.create_connection(("127.0.0.1", store.port), timeout=2).close()


def test_hundreds_of_relayed_connections_share_one_copying_thread():
    """Each relayed connection once had two threads in each relay; at 1,024 workers the coordinator
    ran thousands. Now the bytes of every connection are copied on one thread per process."""
    import threading

    from elastic_zero.wire.rendezvous import LocalRelay

    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, 10)
    relay = LocalRelay("127.0.0.1", server.port, secret)
    before = threading.active_count()
    clients = [relay.client(10) for _ in range(300)]
    for i, client in enumerate(clients):
        client.set(f"k{i}", str(i))
    assert [clients[-1 - i].get(f"k{i}") for i in range(300)] == [str(i).encode() for i in range(300)]
    # the challenge's threads are gone once answered; what stays is the copying thread of each side
    assert threading.active_count() - before <= 4
    # a blocking get waits for its key, without holding up the others
    waiting = []
    getter = threading.Thread(target=lambda: waiting.append(clients[0].get("late")))
    getter.start()
    clients[1].set("other", "x")
    assert clients[2].get("other") == b"x" and not waiting
    clients[3].set("late", "here")
    getter.join(10)
    assert waiting == [b"here"]
    server.close()


def test_the_relay_runs_beside_the_coordinator_and_dies_with_it():
    """The relay's threads once took the coordinator's GIL while its loop sent plans to 1,024 workers:
    it is a process of its own now, which must not outlive the coordinator's process, however that
    ends (here SIGKILL, as Ray kills an actor)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from elastic_zero.wire.rendezvous import RendezvousServer, connect, new_secret\n"
        "secret = new_secret()\n"
        "server = RendezvousServer('127.0.0.1', secret, 10)\n"
        "client = connect('127.0.0.1', server.port, secret, 10)\n"
        "client.set('k', 'v')\n"  # (a set has no answer: its get, on the same way in, is what follows it)
        "assert client.get('k') == b'v' and server.store.get('k') == b'v'\n"
        "print(server.relay_pid, server.port, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    relay_pid, port = map(int, owner.stdout.readline().split())
    assert relay_pid != owner.pid
    # nobody's child, in a session of its own: Ray's cleanup of an actor's children or process group,
    # which comes before the actor's end, does not reach it (test_coordinator_takeover.py)
    with open(f"/proc/{relay_pid}/status") as fh:
        assert f"PPid:\t{owner.pid}" not in fh.read()
    assert os.getsid(relay_pid) == relay_pid != os.getsid(owner.pid)
    # the relay alone holds the listening socket (the owner closed its copy): once the relay is gone,
    # nobody listens there for the job (after it, the port is free and another process may take it)
    listening = _listening_inodes(port)
    assert listening and listening <= _socket_inodes(relay_pid) and not listening & _socket_inodes(owner.pid)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()

    def running() -> bool:  # an ended orphan may stay a zombie where nobody reaps it
        try:
            with open(f"/proc/{relay_pid}/status") as fh:
                return "State:\tZ" not in fh.read()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)  # a process's end can only be polled for from outside its family
    assert not running()


def _listening_inodes(port: int) -> set[int]:
    """The inodes of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.add(int(fields[9]))
    return found


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open."""
    import os

    links = (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    return {int(link[8:-1]) for link in links if link.startswith("socket:[")}
