"""Where a machine's cores go over a stretch of time: every process's CPU (Linux /proc), grouped by
what it is to a job (its workers, the job's own side processes, Ray's, the rest) and the time no
process ran (idle). Two snapshots make a window; nothing runs between them, so the measuring costs
the machine nothing while it is measured (a snapshot reads each process's stat and command line:
about 10 ms on a machine with a few hundred processes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# the job's own processes beside its workers, by what their command lines hold (the driver is the
# process that took the snapshot, or one whose command line runs elastic-zero)
JOB_SIDE = (("ray::Coordinator", "coordinator"), ("wire/heartbeats.py", "beats"), ("wire/beat_drain.py", "beat drain"),
            ("wire/rendezvous.py", "relay"), ("elastic-zero", "driver"), ("elastic_zero.cli", "driver"))
RAY_MARKERS = ("ray::", "/ray/", "raylet", "gcs_server")
GROUPS = ("workers", "job's side", "ray", "other", "idle")


@dataclass(frozen=True)
class Snapshot:
    ticks: dict  # pid -> (CPU ticks so far, its command line)
    idle_ticks: int  # the machine's idle and I/O-wait ticks so far, over all its cores
    total_ticks: int  # every tick so far, over all cores


def snapshot() -> Snapshot:
    """Every process's CPU so far and the machine's idle time (Linux; elsewhere, empty)."""
    ticks = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read(400).replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):  # it ended meanwhile
            continue
        ticks[int(name)] = (int(fields[11]) + int(fields[12]), command)  # utime + stime
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        cpu = [0] * 5
    return Snapshot(ticks, cpu[3] + cpu[4], sum(cpu[:8]))


def group_of(command: str, pid: int, own_pid: int, worker_marker: str) -> tuple[str, str]:
    """(group, name) of a process by its command line: a worker (its command holds `worker_marker`),
    the job's side (JOB_SIDE; the measuring process is the driver), Ray's, or other (named by its
    command's first word)."""
    if worker_marker in command:
        return "workers", "worker"
    if pid == own_pid:
        return "job's side", "driver"
    for marker, name in JOB_SIDE:
        if marker in command:
            return "job's side", name
    first = command.split(" ", 1)[0].rsplit("/", 1)[-1] or "kernel"
    if any(m in command for m in RAY_MARKERS):
        return "ray", first
    return "other", first


def cpu_shares(before: Snapshot, after: Snapshot, worker_marker: str, own_pid: int | None = None,
               cores: int | None = None) -> dict:
    """Between two snapshots, each group's CPU as a share of one core (100: one core busy throughout),
    each process name's within the groups ("by_name": {group: {name: [share, processes]}}), and the
    machine's idle time the same way. Where no tick passed (the same moment twice), every share is 0."""
    own_pid = os.getpid() if own_pid is None else own_pid
    cores = cores or os.cpu_count() or 1
    seconds_ticks = (after.total_ticks - before.total_ticks) / cores  # ticks of one core over the window
    scale = 100.0 / seconds_ticks if seconds_ticks > 0 else 0.0
    groups = dict.fromkeys(GROUPS, 0.0)
    by_name: dict = {g: {} for g in GROUPS[:-1]}
    for pid, (ticks, command) in after.ticks.items():
        was, command_was = before.ticks.get(pid, (0, ""))  # a process born within the window: all of its CPU
        if ticks - was <= 0:
            continue
        # what it was when the window began: one ending as it closes has an empty command line by then
        group, name = group_of(command_was or command, pid, own_pid, worker_marker)
        spent = ticks - was
        groups[group] += spent * scale
        share = by_name[group].setdefault(name, [0.0, 0])
        share[0] += spent * scale
        share[1] += 1
    groups["idle"] = (after.idle_ticks - before.idle_ticks) * scale
    return {"cores": cores, **{g: round(v, 2) for g, v in groups.items()},
            "by_name": {g: {n: [round(s, 2), k] for n, (s, k) in sorted(names.items(), key=lambda kv: -kv[1][0])}
                        for g, names in by_name.items()}}
