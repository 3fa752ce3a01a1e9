"""A node's memory as Ray's memory monitor sees it, and a process's resident memory: read from /proc
and the cgroup files, the standard library only (a worker's beat process reads it at each beat, as
a script of its own: heartbeats.py).

Ray's monitor (its raylet) kills a worker when the node's used memory passes a fraction of its
capacity, `RAY_memory_usage_threshold` (0.95 unless set; `RAY_memory_monitor_refresh_ms = 0` turns
the monitor off). Capacity is the smaller of the machine's memory and the cgroup's limit (a
container's); used is the cgroup's usage less its file cache where there is a cgroup, else the
machine's total less what it has available. This follows ray._private.utils' get_system_memory and
get_used_memory and the monitor's own reading of the cgroup; a worker reads the variables from its
environment, which the raylet that started it gave it.
"""

from __future__ import annotations

import functools
import os
import time

DEFAULT_THRESHOLD = 0.95
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                out[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):  # not Linux: nothing known
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:  # a file this kernel or cgroup version does not have: the figure is not known here
        return None


@functools.cache  # read once: a container's limit does not change under it
def _cgroup_limit() -> int | None:
    return _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes") or _read_int("/sys/fs/cgroup/memory.max")


def capacity_bytes() -> int:
    """The node's memory: the machine's, or its cgroup's limit where that is smaller."""
    total = _meminfo().get("MemTotal", 0)
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def available_bytes() -> int | None:
    """What the kernel says new allocations can take without swapping (MemAvailable), or None where
    /proc/meminfo cannot be read: a bench's size check, which is then skipped."""
    return _meminfo().get("MemAvailable")


def used_bytes() -> int:
    """What the node has in use, as Ray's memory monitor counts it."""
    for usage, stat in (("/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.stat"),
                        ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat")):
        current = _read_int(usage)
        if current is None or _cgroup_limit() is None:
            continue
        cache = 0
        try:
            with open(stat) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key in ("inactive_file", "active_file", "total_inactive_file", "total_active_file"):
                        cache += int(value)
        except (OSError, ValueError):  # no stat file, or one unreadable: the usage is counted with its cache
            pass
        return max(0, current - cache)
    info = _meminfo()
    return max(0, info.get("MemTotal", 0) - info.get("MemAvailable", info.get("MemFree", 0)))


def monitor_threshold() -> float:
    """The fraction of capacity past which Ray's monitor kills (1.0: the monitor is off)."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 1.0
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", DEFAULT_THRESHOLD))
    except ValueError:
        return DEFAULT_THRESHOLD


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (0: it is gone, or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory (VmHWM) since it began, or since it last reset_peak()."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # the process is gone, or this is not Linux: 0, as rss_bytes
        pass
    return 0


class ProcessMemory:
    """A process's resident memory and its peak (VmRSS and VmHWM, bytes; (0, 0) once it is gone), from
    its /proc status kept open and read again in place: a beat process reads them ten times a second,
    and opening two files a beat (statm and status) took a quarter of its CPU."""

    def __init__(self, pid: int) -> None:
        self._path, self._fd = f"/proc/{pid}/status", None

    def __call__(self) -> tuple[int, int]:
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            status = os.pread(self._fd, 8192, 0)
        except OSError:  # the process is gone (or this is not Linux)
            self.close()
            return 0, 0
        try:
            return _kib_field(status, b"VmRSS:"), _kib_field(status, b"VmHWM:")
        except ValueError:  # a field this kernel writes otherwise: not known (a beat process must not fail)
            return 0, 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class BeatMemory:
    """() -> (RSS of process `pid`, its peak, its node's used memory): what a heartbeat carries. The
    process's at every read (ProcessMemory); the node's, several files to read, at most every
    `node_every_s` (the figure before in between)."""

    def __init__(self, pid: int, node_every_s: float) -> None:
        self._process, self._node_every_s = ProcessMemory(pid), node_every_s
        self._used, self._used_at = 0, None

    def __call__(self) -> tuple[int, int, int]:
        now = time.monotonic()
        if self._used_at is None or now - self._used_at >= self._node_every_s:
            self._used, self._used_at = used_bytes(), now
        return (*self._process(), self._used)


def _kib_field(status: bytes, name: bytes) -> int:
    """A "Name:   1234 kB" field of a /proc status, in bytes (0 where it is not there)."""
    at = status.find(name)
    if at < 0:
        return 0
    return int(status[at + len(name):status.index(b"kB", at)]) * 1024


def reset_peak() -> None:
    """This process's peak (VmHWM) starts again from its RSS now (Linux: clear_refs 5), so that a
    generation's peak is its own and not its start-up's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak is the process's whole life's
        pass
