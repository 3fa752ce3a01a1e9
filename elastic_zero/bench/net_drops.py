"""Packets the machine dropped on receipt, as Linux counts them: a socket counts only its own drops
(wire/heartbeats.socket_drops), and a packet dropped before it reached any socket, in a CPU's input
queue, is counted nowhere else. The control plane's bench reads these around a run, to tell where
lost heartbeats went."""

from __future__ import annotations


def kernel_drops() -> dict[str, int]:
    """The machine's counts of received packets dropped (Linux): `backlog`, before any socket, by a
    CPU's input queue over net.core.netdev_max_backlog (/proc/net/softnet_stat's second column,
    summed); UDP's `rcvbuf_errors` and `in_errors` (/proc/net/snmp), every UDP socket's drops
    together, the listener's own count (heartbeats.socket_drops) among them. {} where they cannot
    be read."""
    counts = {}
    try:
        with open("/proc/net/softnet_stat") as fh:
            counts["backlog"] = sum(int(line.split()[1], 16) for line in fh if line.strip())
        with open("/proc/net/snmp") as fh:
            udp = [line.split() for line in fh if line.startswith("Udp:")]
        fields = dict(zip(udp[0][1:], map(int, udp[1][1:])))
        counts["rcvbuf_errors"], counts["in_errors"] = fields["RcvbufErrors"], fields["InErrors"]
    except (OSError, ValueError, IndexError, KeyError):
        return {}
    return counts
