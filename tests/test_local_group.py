"""The local process groups the engine tests and benchmarks run on (testing/local_group.py): children
forked from a fork server that imported torch once. Oracles: the caller's environment at the call,
and the ranks' own answers."""

import os

import pytest

from elastic_zero.testing.local_group import LocalGroupError, run_local_group


def _env_and_rank(ctx, name):
    import torch

    total = torch.tensor([float(ctx.rank + 1)])
    ctx.process_group.allreduce(total).wait()
    return os.environ.get(name), ctx.rank, float(total)


def _fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 was told to fail")
    return ctx.rank


def test_each_child_takes_the_callers_environment_as_it_is_at_the_call(monkeypatch):
    run_local_group(_env_and_rank, 2, ("EZ_LOCAL_GROUP_PROBE",))  # the fork server is started by now
    monkeypatch.setenv("EZ_LOCAL_GROUP_PROBE", "set after the server started")
    assert run_local_group(_env_and_rank, 2, ("EZ_LOCAL_GROUP_PROBE",)) == [
        ("set after the server started", 0, 3.0), ("set after the server started", 1, 3.0)]


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(LocalGroupError, match="rank 1 failed(.|\n)*rank 1 was told to fail"):
        run_local_group(_fail_on_rank_1, 2, timeout_s=60)
