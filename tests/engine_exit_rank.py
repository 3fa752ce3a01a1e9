"""One rank of tests/test_engine_exit.py: trains a few steps with ZeroEngine on the default gloo group,
gathers the state dict, and ends in the teardown order named on the command line, without close()."""

import atexit
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

order, stage = sys.argv[1], int(sys.argv[2])


def _after_the_engines_exit_hook() -> None:
    """Registered before elastic_zero is imported, so it runs after exit_guard's hook: by then no group
    may be left for finalization to tear down (gloo's threads abort the process there)."""
    engine = globals().get("engine")
    left = []
    if dist.is_initialized():
        left.append("the default group is still registered")
    if engine is not None and engine.comm is not None:
        left.append("the engine still holds its group")
    if left:
        print("at exit: " + "; ".join(left), file=sys.stderr, flush=True)
        os._exit(3)


atexit.register(_after_the_engines_exit_hook)

from elastic_zero.zero import AdamW, ZeroEngine  # noqa: E402 - after the hook above, on purpose

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
engine = ZeroEngine(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]), AdamW(lr=1e-3), stage=stage,
                    process_group=dist.group.WORLD)
for _ in range(2):
    engine.backward(engine.module(torch.randn(4, 32)).square().mean())
    engine.step()
    engine.zero_grad()
state = engine.full_state_dict()
dist.barrier()
if order == "destroy_first":  # the group destroyed while the engine is alive
    dist.destroy_process_group()
elif order == "engine_first":  # the engine collected, then the group destroyed
    del engine
    gc.collect()
    dist.destroy_process_group()
elif order != "exit_alive":  # exit_alive: the interpreter exits with both alive
    raise SystemExit(f"unknown order {order!r}")
