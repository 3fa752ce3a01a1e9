"""Ray's driver prints a raylet's note for every worker process that dies ("A worker died or was
killed while executing a task by an unexpected system error ..."): for an elastic job a lost worker
is an event it recovers from, shown as its own line ("worker w1 lost"), not an error. Ray offers no
switch for these notes (log_to_driver=False leaves them), so the one function that prints them is
wrapped here, in one place, dropping only those notes; where Ray has no such function it does nothing.
"""

from __future__ import annotations

WORKER_DIED = "A worker died or was killed while executing a task"


def is_worker_death_note(data: dict) -> bool:
    return data.get("pid") == "raylet" and any(WORKER_DIED in line for line in data.get("lines", ()))


def quiet_worker_deaths() -> bool:
    """Drop the raylet's worker-death notes from this driver's console. True if it could."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return False
    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None:
        return False
    if getattr(printer, "_elastic_zero_quiet", False):
        return True

    def print_to_stdstream(data, *args, **kwargs):
        if not is_worker_death_note(data):
            printer(data, *args, **kwargs)

    print_to_stdstream._elastic_zero_quiet = True
    ray_worker.print_to_stdstream = print_to_stdstream
    return True
