"""The test clusters (testing/local_cluster.py). Their ports: the ones their processes listen on come from
a band of this process's own, below the kernel's ephemeral range, so no connection's source port or
another process's bind(0) can take one between its pick and Ray's bind (seen: a node's agent found
its port taken, and the raylet ended with it). Oracle: the kernel's own range, and bind(). Their temp
dirs go when they stop, unless asked to stay (the nodes' own test checks a real cluster's)."""

import socket

import pytest

from elastic_zero.testing import local_cluster
from elastic_zero.testing.local_cluster import LISTEN_BAND, listen_ports

pytestmark = pytest.mark.unit


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        return int(fh.read().split()[0])


def test_listen_ports_are_this_processs_own_below_the_ephemeral_range_and_skip_a_taken_one():
    first = listen_ports(9)
    assert len(set(first)) == 9 and max(first) < _ephemeral_low()
    base = local_cluster.LISTEN_BAND_START + local_cluster._slot() * LISTEN_BAND
    assert all(base <= p < base + LISTEN_BAND for p in first)
    # the next one in turn is held by a listener (a cluster of this process still up): it is passed over
    local_cluster._listen_cursor = 0
    with socket.socket() as held:
        held.bind(("127.0.0.1", base))
        held.listen()
        again = listen_ports(6)
    assert base not in again and again == [base + i for i in range(1, 7)]
    with pytest.raises(RuntimeError, match=f"no {LISTEN_BAND + 1} free ports left in this process's band"):
        listen_ports(LISTEN_BAND + 1)


def test_a_stopped_clusters_dir_goes_unless_asked_to_stay(tmp_path, monkeypatch):
    kept, removed = tmp_path / "kept", tmp_path / "removed"
    for d in (kept, removed):
        (d / "ray" / "session").mkdir(parents=True)
        (d / "head.log").write_text("ray start\n")
    monkeypatch.setenv(local_cluster.KEEP_DIRS_ENV, "1")
    local_cluster._remove_dir(str(kept))
    monkeypatch.delenv(local_cluster.KEEP_DIRS_ENV)
    local_cluster._remove_dir(str(removed))
    assert (kept / "head.log").read_text() == "ray start\n" and not removed.exists()
