"""Aborting a gloo group breaks a wait on a live peer at once (gloo's own abort() does not)."""

import gc
import threading
import time

import pytest
import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.zero import TorchComm
from elastic_zero.zero.abortable import AbortableGroup, GroupAborted

TIMEOUT_S = 30.0


def _blocked_on_a_live_peer(ctx):
    comm = TorchComm(ctx.process_group)
    assert isinstance(ctx.process_group, AbortableGroup)
    comm.all_reduce(torch.ones(4))  # connected and working
    if ctx.rank == 0:  # alive and silent: never sends what rank 1 waits for
        ctx.store.get("rank1-done")
        return None
    received = comm.recv(torch.empty(4), 0)  # waited for by the helper thread
    reduced = comm.all_reduce(torch.ones(4), async_op=True)  # waited for through its future
    threading.Timer(0.3, ctx.process_group.abort).start()
    started = time.monotonic()
    with pytest.raises(GroupAborted):
        received.wait()
    waited = time.monotonic() - started
    with pytest.raises(GroupAborted):  # and every later wait fails at once
        reduced.wait()
    # letting go of an aborted group with work still in flight returns at once (the runtime test of
    # a loss before a scale-up's first commit is where destroying one was seen to wait 30 s)
    started = time.monotonic()
    del comm, received, reduced
    ctx.process_group = None
    gc.collect()
    dropped = time.monotonic() - started
    ctx.store.set("rank1-done", "1")
    return waited, dropped


def test_an_abort_breaks_a_wait_on_a_live_peer_long_before_the_timeout():
    _, (waited, dropped) = run_local_group(_blocked_on_a_live_peer, 2, timeout_s=TIMEOUT_S)
    assert 0.25 <= waited < 5.0
    assert dropped < 5.0


def _completed_work(ctx):
    comm = TorchComm(ctx.process_group)
    t = torch.full((3,), float(ctx.rank + 1))
    comm.all_reduce(t)
    ctx.process_group.abort()  # after the fact: results already in stay valid
    return t.tolist()


def test_work_completed_before_an_abort_keeps_its_result():
    assert run_local_group(_completed_work, 2) == [[3.0, 3.0, 3.0]] * 2
