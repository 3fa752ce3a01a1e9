"""A program that uses ZeroEngine exits 0 whatever order it tears down in, with no close() call.

Each run is a fresh set of processes, since the failure is at interpreter exit: a gloo thread that
frees an engine's finished work during finalization aborts the process ("terminate called without an
active exception"; see zero/exit_guard.py). That race is rare on an idle machine (seen here in one run
of six to one of thirty-six before the fix), so each rank also checks from an exit hook of its own,
run after the engine's, that no group is left for finalization: before the fix every run of
"destroy_first" and "exit_alive" failed that check (exit 3), whatever the stage. So one run per case
suffices for the check, each case starting at another stage (the six cases cover stages 1-3 twice);
the rare abort itself needs many: `ELASTIC_ZERO_EXIT_RUNS=30 python -m pytest tests/test_engine_exit.py`
(each case's runs go through the stages in turn)."""

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

RANK_SCRIPT = os.path.join(os.path.dirname(__file__), "engine_exit_rank.py")
RUNS = int(os.environ.get("ELASTIC_ZERO_EXIT_RUNS", "1"))
ORDERS = ["destroy_first", "engine_first", "exit_alive"]


def _run_once(order: str, world_size: int, stage: int) -> list[tuple[int, str]]:
    """(exit code, stderr) of each rank of one run; the store lives here, so no rank's exit takes it down."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world_size),
               TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, RANK_SCRIPT, order, str(stage)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world_size)]
    out = [(p.wait(timeout=120), p.stderr.read()) for p in ranks]
    del store
    return out


@pytest.mark.runtime
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.long)])  # 3: the long tier
@pytest.mark.parametrize("order", ORDERS)
def test_every_teardown_order_exits_zero(order, world_size):
    failures = []
    first_stage = (2 * ORDERS.index(order) + world_size - 2) % 3  # each order at two stages, each stage twice
    for run in range(RUNS):
        stage = 1 + (first_stage + run) % 3
        for rank, (code, err) in enumerate(_run_once(order, world_size, stage)):
            if code != 0:
                failures.append(f"run {run} (stage {stage}) rank {rank}: exit {code}: {err.strip()[-300:]}")
    assert not failures, "\n".join(failures)
