"""SIGTERM to a worker's process (Kubernetes deleting its pod, a node agent stopping it) read as a
notice: the worker is to go after a grace period. The handler only wakes a thread, which tells
the coordinator; the process ends at the grace period's end (or at a second SIGTERM) if the
coordinator has not retired it by then."""

from __future__ import annotations

import os
import signal
import threading

GRACE_ENV = "ELASTIC_ZERO_TERMINATION_GRACE_S"  # e.g. the pod's terminationGracePeriodSeconds, less a margin


def termination_grace_s(default_s: float) -> float:
    """The grace period: $ELASTIC_ZERO_TERMINATION_GRACE_S when it is a number >= 0, else the spec's."""
    try:
        value = float(os.environ.get(GRACE_ENV, ""))
    except ValueError:
        return default_s
    return value if value >= 0 else default_s


def catch_sigterm(on_notice, grace_s: float) -> bool:
    """Install the handler (only the main thread may): at a SIGTERM, the process is set to end in
    `grace_s`, then `on_notice(grace_s)` runs on a thread of its own. False where it could not be
    installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    received = threading.Event()

    def handler(signum, frame) -> None:
        if received.is_set():  # asked twice: go now
            os._exit(128 + signal.SIGTERM)
        received.set()

    def tell() -> None:
        received.wait()
        # first the end (telling may hang when the cluster itself is going), then the notice
        threading.Timer(grace_s, os._exit, (128 + signal.SIGTERM,)).start()
        try:
            on_notice(grace_s)
        except Exception:  # noqa: BLE001 - nobody to tell: the timer ends it
            pass

    signal.signal(signal.SIGTERM, handler)
    threading.Thread(target=tell, daemon=True, name="sigterm").start()
    return True
