"""The baseline the benchmarks compare with: the same model, data and global batch under an elastic
Ray Train TorchTrainer (DDP on gloo, `ScalingConfig(num_workers=(min, max))`, `FailureConfig`, a
checkpoint every few steps, resumed from the latest one after each restart or resize), used the way
Ray Train's docs recommend, its preemption notice included (`ray.train.get_preemption_info()` every
step, a just-in-time checkpoint when it says a node goes).

Rank 0 appends one JSON line per completed step to `config["log"]`: the step, when it started and
ended, the world size and the attempt (one id per start of the training function). Run in-process
(`run_trainer`) or as a cluster's driver: `python -m elastic_zero.bench.ray_train_job CONFIG.json`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid

import torch

from elastic_zero.data import MarkovTokens
from elastic_zero.models import PRESETS, build_preset, lm_loss
from elastic_zero.plan.batches import loss_weight, micro_batch_count, micro_batches, rank_positions


def _save(model, opt, step: int, rank: int) -> None:
    """Every rank reports; rank 0's report carries the checkpoint (DDP: every rank holds the same)."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       os.path.join(d, "state.pt"))
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


def _agree_to_stop(config: dict) -> bool:
    """The bench asks the run to end by creating `stop_file`; the ranks agree on it (a rank that
    left alone would hang the others in the next all-reduce)."""
    flag = torch.tensor([1.0 if os.path.exists(config["stop_file"]) else 0.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def train_loop(config: dict) -> None:
    """One Ray Train worker. Optional: `kill_step` (rank 1 exits there once, `marker` records
    when), `stop_file`, `preemption` (watch for notices)."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = ray.train.torch.prepare_model(build_preset(config["preset"], seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    cfg = PRESETS[config["preset"]]
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    batch, log, attempt = config["global_batch"], config["log"], uuid.uuid4().hex[:8]
    saved_for_notice = False
    for step in range(start, config["steps"]):
        if config.get("stop_file") and step % 5 == 0 and _agree_to_stop(config):  # every few steps: a collective
            return
        if step == config.get("kill_step") and rank == 1 and not os.path.exists(config["marker"]):
            with open(config["marker"], "w") as fh:
                fh.write(repr(time.time()))
            os._exit(1)
        started = time.time()
        positions = rank_positions(step, batch, world, rank)
        for m in micro_batches(positions, micro_batch_count(batch, world, config["micro_batch"])):
            x, y = data.batch(m or positions[:1])  # an empty piece: a stand-in of weight 0
            (lm_loss(model(x), y) * loss_weight(len(m), batch, world)).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(log, "a") as fh:
                fh.write(json.dumps({"step": step, "started": started, "done": time.time(), "world": world,
                                     "attempt": attempt}) + "\n")
        if (step + 1) % config["checkpoint_every"] == 0:
            _save(model, opt, step + 1, rank)
        elif config.get("preemption") and not saved_for_notice and ray.train.get_preemption_info() is not None:
            _save(model, opt, step + 1, rank)  # just in time: the restart resumes from here
            saved_for_notice = True


def run_trainer(config: dict, min_workers: int, max_workers: int, storage: str, name: str,
                label_selector: dict | None = None) -> None:
    """`label_selector`: the node labels each worker asks for (an autoscaled cluster's spot nodes)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=(min_workers, max_workers), use_gpu=False,
                                     resources_per_worker={"CPU": 1}, label_selector=label_selector),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=10),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    ).fit()


def main(argv: list[str]) -> int:
    """As a cluster's driver: `CONFIG.json` holds `address`, `min_workers`, `max_workers`, `storage`,
    `name`, the training function's config and optionally a `label_selector`."""
    import ray

    with open(argv[0]) as fh:
        job = json.load(fh)
    ray.init(address=job["address"], logging_level="ERROR")
    run_trainer(job["config"], job["min_workers"], job["max_workers"], job["storage"], job["name"],
                job.get("label_selector"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
