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
end, whether it committed, the participants, and the process's attempt id.

Run by the supervisor (`run_torchft`), a group is `python -m elastic_zero.bench.torchft_job CONFIG GROUP`.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import uuid

MISSING = ("torchft is not installed: pip install -e '.[anchors]' (the comparisons' extra)")


def lighthouse_command() -> str | None:
    """torchft's lighthouse executable: beside this interpreter (a virtual environment not on PATH),
    else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")


def torchft_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchft") is not None and lighthouse_command() is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exited(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """The indices of `procs` that have exited, waiting (on their pidfds) until one has or the
    timeout passes."""
    fds = [os.pidfd_open(p.pid) for p in procs]
    try:
        select.select(fds, [], [], max(0.0, timeout_s))
    finally:
        for fd in fds:
            os.close(fd)
    return [i for i, p in enumerate(procs) if p.poll() is not None]


def replica_group(config: dict, group: int) -> None:
    """One replica group's training loop (its own process)."""
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

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
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    updates = []  # one entry per update that ran: torchft's Optimizer steps only on a commit
    opt.register_step_post_hook(lambda *_: updates.append(1))
    cfg = PRESETS[config["preset"]]
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    groups, batch, attempt = config["groups"], config["global_batch"], uuid.uuid4().hex[:8]
    reported_bytes = False
    try:
        while manager.current_step() < config["steps"]:
            step = manager.current_step()
            # (>=: a group may have joined past the step, healed from the other)
            if step >= config["kill_step"] and group == 1 and not os.path.exists(config["marker"]):
                with open(config["marker"], "w") as fh:
                    fh.write(repr(time.time()))
                os._exit(1)
            optimizer.zero_grad()  # starts the quorum
            positions = rank_positions(step, batch, groups, group)
            for m in micro_batches(positions, micro_batch_count(batch, groups, config["micro_batch"])):
                x, y = data.batch(m or positions[:1])  # an empty piece: a stand-in of weight 0
                (lm_loss(ddp(x), y) * loss_weight(len(m), batch, groups)).backward()
            before = len(updates)
            optimizer.step()  # steps only if every participant's all-reduce went through
            # (a healing group learns the step it joins at during the step: the count after it tells)
            committed = len(updates) > before
            line = {"group": group, "step": manager.current_step() - 1 if committed else step, "done": time.time(),
                    "committed": committed, "participants": manager.num_participants(), "attempt": attempt}
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


def run_torchft(config: dict, groups: int, work_dir: str, timeout_s: float = 900.0) -> list[dict]:
    """Start a lighthouse and `groups` replica groups, start the killed group again once, and return
    every group's step log. Any other exit of a group is an error naming it and its last output line.
    Stops everything it started."""
    import torch.distributed as dist

    if not torchft_installed():
        raise ValueError(MISSING)
    os.makedirs(work_dir, exist_ok=True)
    config = {**config, "groups": groups, "log": os.path.join(work_dir, "torchft_steps.jsonl")}
    config_path = os.path.join(work_dir, "torchft_config.json")
    with open(config_path, "w") as fh:
        json.dump(config, fh)
    lighthouse_port = _free_port()
    lighthouse = subprocess.Popen(
        [lighthouse_command(), "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
         "--bind", f"[::]:{lighthouse_port}"],
        stdout=open(os.path.join(work_dir, "lighthouse.log"), "wb"), stderr=subprocess.STDOUT)
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(groups)]
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}", "MASTER_ADDR": "127.0.0.1",
           "RANK": "0", "WORLD_SIZE": "1"}

    def start(group: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "elastic_zero.bench.torchft_job", config_path, str(group)],
                                env={**env, "MASTER_PORT": str(stores[group].port)},
                                stdout=open(os.path.join(work_dir, f"group-{group}.log"), "ab"),
                                stderr=subprocess.STDOUT)

    procs = {g: start(g) for g in range(groups)}
    restarted: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while procs:
            for g in _exited([lighthouse, *procs.values()], deadline - time.monotonic()):
                if g == 0:
                    raise RuntimeError(f"the torchft lighthouse exited with {lighthouse.returncode}; see {work_dir}")
                group, p = list(procs.items())[g - 1]
                if p.returncode == 0:
                    del procs[group]
                elif group == 1 and os.path.exists(config["marker"]) and group not in restarted:
                    restarted.add(group)  # the planned kill: the supervisor's restart, as torchrun's or torchx's
                    procs[group] = start(group)
                else:
                    raise RuntimeError(f"torchft replica group {group} exited with {p.returncode}: "
                                       f"{_last_line(os.path.join(work_dir, f'group-{group}.log'))}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the torchft run did not end within {timeout_s:.0f} s; see {work_dir}")
    finally:
        for p in [*procs.values(), lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(config["log"]) as fh:
        return [json.loads(line) for line in fh]


def _last_line(path: str) -> str:
    with open(path, "rb") as fh:
        lines = [line for line in fh.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def main(argv: list[str]) -> int:
    with open(argv[0]) as fh:
        config = json.load(fh)
    replica_group(config, int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
