"""Engines still open when the interpreter exits: closed, and their process group destroyed, while
the interpreter is still whole.

Why: a gloo worker thread that drops the last reference to a finished collective's work frees the
work's tensors, and freeing a tensor that Python has seen takes the GIL. Once interpreter
finalization has begun, a thread that asks for the GIL is ended by CPython with a forced unwind, and
that unwind through a noexcept destructor is std::terminate: "terminate called without an active
exception", SIGABRT, a job marked failed (pytorch/pytorch#190489). The engine drops the handles of
the collectives it waited for at once, and `dist.barrier()` keeps strong references to the work
still in progress, so the last release of an engine's work often falls to a gloo thread just as a
script ends. The same holds when the engine keeps a group alive past `destroy_process_group()`:
the group's destructor, and every release in it, then runs during finalization.

So at exit (an `atexit` hook, registered when this module is first imported, and so run after the
hooks a program registers later), every engine not yet closed is closed (its collectives finished,
its hooks and its reference to the group dropped), and a group it trained on that torch still has
registered is destroyed with `destroy_process_group`, which joins the group's threads before the
interpreter starts to come down. A group the program destroyed itself is then released with the
engine's last reference. Any teardown order of the program's own exits 0: destroy before the engine
is collected, the engine collected first, or neither.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref

_open_engines: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()


def track(engine) -> None:
    """Close `engine` at interpreter exit unless it is closed before."""
    with _lock:
        _open_engines.add(engine)


def untrack(engine) -> None:
    with _lock:
        _open_engines.discard(engine)


def torch_group(comm):
    """The torch.distributed group under a Comm (unwrapping an AbortableGroup), or None."""
    group = getattr(comm, "pg", None)
    return getattr(group, "pg", group)


def _registered(group) -> bool:
    """Whether torch.distributed still lists `group` (the program has not destroyed it)."""
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return False
    from torch.distributed import distributed_c10d

    return group in distributed_c10d._world.pg_map


def close_open_engines() -> None:
    with _lock:
        engines = list(_open_engines)
    for engine in engines:
        group = torch_group(engine.comm)
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - said, and the group is still destroyed below
            print(f"elastic_zero: closing a ZeroEngine at exit failed: {exc}", file=sys.stderr)
        del engine
        if _registered(group):
            import torch.distributed as dist

            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - said; nothing else is left to do at exit
                print(f"elastic_zero: destroying the engine's process group at exit failed: {exc}",
                      file=sys.stderr)


atexit.register(close_open_engines)
