"""When this worker's node came up, as far as Ray goes: its raylet's start (the raylet starts each
worker process). An autoscaled replacement's timeline reads it: the node was asked for, came up,
and its worker joined."""

from __future__ import annotations

import os
import time


def raylet_started_at(pid: int | None = None) -> float | None:
    """The epoch time the parent of `pid` (default: this process) started, if that parent is a
    raylet; None when it is not (a driver, a test) or /proc cannot tell (not Linux)."""
    try:
        ppid = int(_stat(pid or os.getpid())[1])
        with open(f"/proc/{ppid}/cmdline", "rb") as fh:
            if os.path.basename(fh.read().split(b"\0", 1)[0]) != b"raylet":
                return None
        started_ticks = int(_stat(ppid)[19])
    except (OSError, ValueError, IndexError):
        return None
    # The boot's epoch time from the clocks, not /proc/stat's btime: that is whole seconds, up to 1 s
    # early (0.6 s on one machine here), and a node the autoscaler starts within a second of the ask
    # then came up before it was asked for. A process's start is counted in ticks of the boot clock.
    booted_at = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return booted_at + started_ticks / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): state is [0]."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()
