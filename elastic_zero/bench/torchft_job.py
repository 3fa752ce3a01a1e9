"""The torchft peer the benchmarks compare with: the same model, data and global batch under torchft
(PyTorch's per-step fault tolerance), set up as its README and `train_ddp.py` recommend:

- a lighthouse (`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`);
- one replica group per worker, each one process (group world size 1, as `train_ddp.py` runs DDP)
  with torchft's `Manager` (`min_replica_size=1`, a 30 s timeout, `ProcessGroupGloo` with a 5 s
  timeout, its default HTTP checkpoint transport for live recovery), its `DistributedDataParallel`
  and `Optimizer` wrappers;
- each group hosting nothing itself: the TCPStore a group's manager connects to is the supervisor's
  (what torchrun provides), and a group that dies is started again by the supervisor loop here, as
  torchrun's restarts or torchx would, and heals from a live peer.

Each group trains its share of every step's global batch (`rank_positions` over the groups, as
torchft's `DistributedSampler` shards by replica group); a lost group's share of the steps it misses
is dropped, as in torchft. Every attempted step is logged as one JSON line: the group, the step, its
start (before the quorum) and end, whether it committed, the participants, whether this group took
part (a healing group's gradients count zero), its share of the batch, and the process's attempt id.

Each group reads the shared config: `kill_step` and `marker` (the recovery bench: group 1 kills itself
once at that step), `stop_file` (the goodput bench: once it holds a step number, every group stops
when it reaches it, so that all stop at the same step), `stock_ddp_hook` (see `_ddp`). Started by a
supervisor holding a `TorchftCluster` (bench/torchft_cluster.py), a group is
`python -m elastic_zero.bench.torchft_job CONFIG GROUP`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid


def _stop_at(path: str | None) -> float:
    """The step at which the supervisor asked every group to stop (never, until it asks)."""
    try:
        with open(path) as fh:
            return int(fh.read())
    except (TypeError, OSError, ValueError):  # no stop file configured, not asked yet, or being written
        return float("inf")


def _ddp(manager, model, stock: bool):
    """torchft's DistributedDataParallel. Its 0.2.0 comm hook fails the process whenever an
    all-reduce fails (`assert fut._fut`: a gloo timeout, as a frozen peer causes, leaves the managed
    future unset), where the manager has already noted the error and will not commit the step. Unless
    `stock`, the hook instead hands DDP the bucket as it is, and the step is discarded as torchft
    intends. (Stock, the survivors of a frozen node all exit, and with no live peer left the
    restarted groups begin again at step 0.)"""
    import torch
    from torchft import DistributedDataParallel

    if stock:
        return DistributedDataParallel(manager, model)

    class ErrorTolerantDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            reduced = getattr(work.get_future(), "_fut", None) if work.wait() else None
            if reduced is not None:
                return reduced
            failed = torch.futures.Future()  # the manager saw the error: this step will not commit
            failed.set_result(bucket.buffer())
            return failed

    return ErrorTolerantDDP(manager, model)


def replica_group(config: dict, group: int) -> None:
    """One replica group's training loop (its own process)."""
    from datetime import timedelta

    import torch
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from elastic_zero.data import MarkovTokens
    from elastic_zero.models import PRESETS, build_preset, lm_loss
    from elastic_zero.plan.batches import loss_weight, micro_batch_count, micro_batches, rank_positions

    torch.set_num_threads(1)
    model = build_preset(config["preset"], seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])),
                      state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                      replica_id=f"bench_{group}", timeout=timedelta(seconds=30))
    ddp = _ddp(manager, model, config.get("stock_ddp_hook", False))
    optimizer = Optimizer(manager, opt)
    updates = []  # one entry per update that ran: torchft's Optimizer steps only on a commit
    opt.register_step_post_hook(lambda *_: updates.append(1))
    cfg = PRESETS[config["preset"]]
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    groups, batch, attempt = config["groups"], config["global_batch"], uuid.uuid4().hex[:8]
    reported_bytes = False
    try:
        while manager.current_step() < min(config["steps"], _stop_at(config.get("stop_file"))):
            step = manager.current_step()
            # (>=: a group may have joined past the step, healed from the other)
            if config.get("kill_step") is not None and step >= config["kill_step"] and group == 1 \
                    and not os.path.exists(config["marker"]):
                with open(config["marker"], "w") as fh:
                    fh.write(repr(time.time()))
                os._exit(1)
            started = time.time()
            optimizer.zero_grad()  # starts the quorum
            positions = rank_positions(step, batch, groups, group)
            for m in micro_batches(positions, micro_batch_count(batch, groups, config["micro_batch"])):
                x, y = data.batch(m or positions[:1])  # an empty piece: a stand-in of weight 0
                (lm_loss(ddp(x), y) * loss_weight(len(m), batch, groups)).backward()
            participating = manager.is_participating()  # a healing group's gradients count zero
            before = len(updates)
            optimizer.step()  # steps only if every participant's all-reduce went through
            # (a healing group learns the step it joins at during the step: the count after it tells)
            committed = len(updates) > before
            line = {"group": group, "step": manager.current_step() - 1 if committed else step, "started": started,
                    "done": time.time(), "committed": committed, "participants": manager.num_participants(),
                    "participating": participating, "samples": len(positions), "attempt": attempt}
            if not reported_bytes and line["committed"]:  # a full replica: parameters, gradients, AdamW state
                state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
                line["state_bytes"] = sum(t.untyped_storage().nbytes() for t in
                                          [*model.parameters(), *(p.grad for p in model.parameters()
                                                                  if p.grad is not None), *state])
                reported_bytes = True
            with open(config["log"], "a") as fh:
                fh.write(json.dumps(line) + "\n")
    finally:
        manager.shutdown(wait=False)


def main(argv: list[str]) -> int:
    with open(argv[0]) as fh:
        config = json.load(fh)
    replica_group(config, int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
