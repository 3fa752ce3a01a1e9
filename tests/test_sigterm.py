"""SIGTERM read as a notice (preemption/sigterm.py), in a real child process: the notice is told
with the grace period, the process ends when the grace period is over, and at once at a second
SIGTERM. The oracle: the child's exit code and the time it took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elastic_zero.preemption.sigterm import GRACE_ENV, termination_grace_s

pytestmark = pytest.mark.unit

CHILD = textwrap.dedent("""
    import sys, time
    from elastic_zero.preemption.sigterm import catch_sigterm
    assert catch_sigterm(lambda grace_s: print(f"notice {grace_s}", flush=True), float(sys.argv[1]))
    print("ready", flush=True)
    while True:
        time.sleep(0.05)  # the main thread at work, as a worker's task loop is
""")


def _child(grace_s: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(grace_s)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_sigterm_is_a_notice_and_the_process_ends_after_the_grace_period():
    child = _child(1.0)
    sent = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    assert child.stdout.readline().strip() == "notice 1.0"
    assert child.wait(timeout=20) == 128 + signal.SIGTERM
    assert time.monotonic() - sent >= 1.0


def test_a_second_sigterm_ends_it_at_once():
    child = _child(60.0)
    os.kill(child.pid, signal.SIGTERM)
    assert child.stdout.readline().strip() == "notice 60.0"
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(timeout=20) == 128 + signal.SIGTERM


def test_the_grace_period_from_the_environment(monkeypatch):
    assert termination_grace_s(30.0) == 30.0
    monkeypatch.setenv(GRACE_ENV, "12.5")
    assert termination_grace_s(30.0) == 12.5
    for bad in ("soon", "-1"):
        monkeypatch.setenv(GRACE_ENV, bad)
        assert termination_grace_s(30.0) == 30.0
