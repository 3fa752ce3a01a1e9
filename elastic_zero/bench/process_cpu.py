"""Where a machine's cores go over a stretch of time: every process's CPU (Linux /proc), grouped by
what it is to a job (its workers, the job's own side processes, Ray's, the rest), the time no process
ran (idle) and the time the kernel spent on interrupts or a hypervisor took (irq and steal). A window
is two snapshots; between them nothing is read (a snapshot reads each process's stat and command line:
about 10 ms on a machine with a few hundred processes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# the job's own processes beside its workers, by what their command lines hold; the driver is the
# process that took the snapshots, or one that runs elastic-zero (driver_of)
JOB_SIDE = (("ray::Coordinator", "coordinator"), ("wire/heartbeats.py", "beats"), ("wire/beat_drain.py", "beat drain"),
            ("wire/rendezvous.py", "relay"))
RAY_MARKERS = ("ray::", "site-packages/ray/", "/raylet ", "/gcs_server ")  # Ray's processes, scripts and binaries
GROUPS = ("workers", "job's side", "ray", "other", "idle", "irq and steal")


@dataclass(frozen=True)
class Snapshot:
    processes: dict  # pid -> (CPU ticks so far, its start time in ticks after boot, its command line)
    idle_ticks: int  # the machine's idle and I/O-wait ticks so far, over all its cores
    irq_ticks: int  # its interrupts', soft interrupts' and stolen (a hypervisor's) ticks so far
    total_ticks: int  # every tick so far, over all cores
    cores: int  # the cores /proc/stat counts


def process_times(pid: int) -> tuple[int, int]:
    """(its CPU so far, utime + stime; its start, after boot), in clock ticks; OSError once it is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), int(fields[19])


def snapshot() -> Snapshot:
    """Every process's CPU so far and the machine's idle time (Linux; elsewhere, empty)."""
    processes = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            cpu, started = process_times(int(name))
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read(400).replace(b"\0", b" ").decode(errors="replace").strip()
            processes[int(name)] = (cpu, started, command)
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        cpu = [int(v) for v in lines[0].split()[1:]]
        cores = sum(1 for line in lines[1:] if line.startswith("cpu"))
    except (OSError, ValueError, IndexError):
        cpu, cores = [0] * 8, os.cpu_count() or 1
    cpu += [0] * (8 - len(cpu))
    return Snapshot(processes, cpu[3] + cpu[4], cpu[5] + cpu[6] + cpu[7], sum(cpu[:8]), max(1, cores))


def driver_of(command: str) -> bool:
    """Whether a command line runs elastic-zero's CLI (its script, or the module)."""
    words = command.split(" ", 3)
    return any(os.path.basename(w) == "elastic-zero" for w in words[:2]) or "elastic_zero.cli" in words[:3]


def group_of(command: str, pid: int, own_pid: int, worker_marker: str) -> tuple[str, str]:
    """(group, name) of a process by its command line: a worker (its command holds `worker_marker`),
    the job's side (JOB_SIDE; the measuring process and elastic-zero's CLI are the driver), Ray's, or
    other (named by its command's first word)."""
    if worker_marker in command:
        return "workers", "worker"
    if pid == own_pid or driver_of(command):
        return "job's side", "driver"
    for marker, name in JOB_SIDE:
        if marker in command:
            return "job's side", name
    first = command.split(" ", 1)[0].rsplit("/", 1)[-1] or "kernel"
    if any(m in command + " " for m in RAY_MARKERS):
        return "ray", first
    return "other", first


def cpu_shares(before: Snapshot, after: Snapshot, worker_marker: str, own_pid: int | None = None) -> dict:
    """Between two snapshots, each group's CPU as a share of one core (100: one core busy throughout),
    each process name's within the groups ("by_name": {group: {name: [share, processes]}}), and the
    machine's idle, irq and steal time the same way. Where no tick passed (the same moment twice), every
    share is 0."""
    own_pid = os.getpid() if own_pid is None else own_pid
    one_core_ticks = (after.total_ticks - before.total_ticks) / after.cores  # one core's ticks over the window
    scale = 100.0 / one_core_ticks if one_core_ticks > 0 else 0.0
    groups = dict.fromkeys(GROUPS, 0.0)
    by_name: dict = {g: {} for g in GROUPS[:4]}
    for pid, (ticks, started, command) in after.processes.items():
        was, started_was, command_was = before.processes.get(pid, (0, None, ""))
        if started_was != started:  # born within the window (its pid maybe another's before): all of its CPU
            was, command_was = 0, ""
        if ticks - was <= 0:
            continue
        # what it was when the window began: one ending as it closes has an empty command line by then
        group, name = group_of(command_was or command, pid, own_pid, worker_marker)
        spent = (ticks - was) * scale
        groups[group] += spent
        share = by_name[group].setdefault(name, [0.0, 0])
        share[0] += spent
        share[1] += 1
    groups["idle"] = (after.idle_ticks - before.idle_ticks) * scale
    groups["irq and steal"] = (after.irq_ticks - before.irq_ticks) * scale
    return {"cores": after.cores, **{g: round(v, 2) for g, v in groups.items()},
            "by_name": {g: {n: [round(s, 2), k] for n, (s, k) in sorted(names.items(), key=lambda kv: -kv[1][0])}
                        for g, names in by_name.items()}}
