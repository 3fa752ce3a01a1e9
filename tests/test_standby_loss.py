"""A standby worker that dies while it waits (a real SIGKILL of its process, on a real local Ray): the
coordinator has no call in flight to it, so before 2026-11-30 nobody noticed until a recovery took it,
and that recovery's generation failed at its start. Now its beat process's last word (or its
silence) retires it at once and another is asked for; the kill that follows is recovered by the
replacement. Oracle: torch's AdamW on one process, and the one recovery the drill caused."""

import json
import os
import signal
import threading
import time

import pytest

from runtime_jobs import exactly_once, job, relative
from test_runtime import _once_ready

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]


def _kill_the_standby_once_it_waits(events_path: str, killed: dict) -> threading.Thread:
    """A thread that SIGKILLs the ready worker the first generation left out, once it started."""
    def run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = open(events_path).read().splitlines() if os.path.exists(events_path) else []
            events = [json.loads(line) for line in lines if line.strip()]
            starts = [e for e in events if e["event"] == "generation_start"]
            ready = {e["actor_id"]: e["pid"] for e in events if e["event"] == "worker_ready"}
            standby = [a for a in ready if starts and a not in starts[0]["workers"]]
            if standby:
                killed.update(actor_id=standby[0], t=time.time())
                os.kill(ready[standby[0]], signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_standby_killed_while_it_waits_is_replaced_before_a_recovery_needs_it(tmp_path, torch_adamw):
    reference = torch_adamw(16)
    events_path = str(tmp_path / "standby-loss" / "events.jsonl")
    killed: dict = {}
    killer = _kill_the_standby_once_it_waits(events_path, killed)
    # the first step waits for a fourth worker's hello: the dead standby's replacement
    code, summary, events, weights = job(tmp_path, "standby-loss", [{"at_step": 8, "action": "kill", "rank": 1}],
                                         train={"steps": 16, "loss": _once_ready(events_path, 4)},
                                         elastic={"workers": 2, "max_workers": 2, "standby_workers": 1})
    killer.join(timeout=5)
    assert code == 0, summary.get("error")
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert lost[0]["actor_id"] == killed["actor_id"] and lost[0]["during"] == "ready", lost
    assert lost[0]["t"] - killed["t"] < 5.0, (lost[0], killed)  # the next look after its last word (0.1 s here)
    retired = next(e for e in events if e["event"] == "retire" and killed["actor_id"] in e["actor_ids"])
    spawns = [e for e in events if e["event"] == "spawn"]
    assert spawns[0]["count"] == 3 and spawns[1]["count"] == 1 and spawns[1]["t"] >= retired["t"]
    (replacement,) = spawns[1]["actor_ids"]
    # one recovery, the drill's, from memory and with the replacement at once: no generation failed at its start
    starts = [e for e in events if e["event"] == "generation_start"]
    assert len(starts) == 2 and starts[1]["source"] == "snapshot" and starts[1]["step"] == 8
    assert replacement in starts[1]["workers"] and killed["actor_id"] not in starts[1]["workers"]
    # the standby is taken in the recovery itself: nothing is spawned for it before the recovery began
    assert all(events.index(s) > events.index(starts[1]) for s in spawns[2:]), "a worker was spawned before the recovery began"
    (recovery,) = summary["recoveries"]
    assert recovery["lost_steps"] == 0 and summary["world_size_history"][:2] == [[0, 2], [8, 2]]
    exactly_once(summary)
    assert relative(reference, weights) <= 1e-4
