"""The heartbeats of one simulated host's workers (sim_workers.py): a process of their own, as each
real worker's beats come from a process of its own (heartbeats.start_beat_process)."""

from __future__ import annotations

import os
import time

BEAT_NICE = -10  # the beat processes' niceness, where the kernel allows it (root, or CAP_SYS_NICE)


def beat_for_host(conn, host: str, port: int, secret: bytes, step_s: float, longest_gap, refused) -> None:
    """Each live simulated worker's heartbeat, one datagram each, as worker/node_duties.py sends it:
    from a process of its own, so that the host's threads (hundreds of simulated workers) never delay
    it, as a real worker's training never delays its own beats (heartbeats.start_beat_process). Ends
    when the host goes. A beat carries its worker's progress as a real one's does: the step its
    generation's clock is at, in the "compute" phase, so that the coordinator's listener and its
    stuck rule see beats that move (a progress that never moved cost the rule its whole scan)."""
    from elastic_zero.job.spec import HEARTBEAT_EVERY_S
    from elastic_zero.wire.beat_drain import run_ahead
    from elastic_zero.wire.heartbeats import NO_PROGRESS, PHASES, HeartbeatSender, beat_token

    # in a session of its own, as a real worker's beat process (heartbeats.start_beat_process): where the
    # kernel groups processes by session (autogroup), it is not one among its host's hundreds of threads
    # (on two cores at 1,024 workers its longest gap between beats still reached 1.4-2.3 s, and live
    # workers were declared silent: the machine, not the coordinator; docs/benchmarks.md)
    os.setsid()
    # and ahead of the host's hundreds of threads where the kernel allows it: on two cores at 1,024 workers
    # a starved round took 0.43-0.92 s to send, and live workers looked silent for the harness's load,
    # not the coordinator's (a real worker's beat process shares its machine with that one worker only)
    run_ahead(BEAT_NICE)

    sender, beating, last = HeartbeatSender(host, port, beat_token(secret)), [], time.monotonic()
    clocks: dict[str, tuple[int, int, float]] = {}  # actor id -> (its generation, the first step, when it began)
    compute = PHASES.index("compute")
    while True:
        try:
            while conn.poll(HEARTBEAT_EVERY_S if not beating else 0):
                told = conn.recv()
                if isinstance(told, tuple):  # ("clock", generation, first step, began, its members here)
                    clocks.update(dict.fromkeys(told[4], told[1:4]))
                else:
                    beating = told
        except (EOFError, OSError):  # the host is gone
            return
        now = time.monotonic()
        previous_start = last
        last = now
        epoch = time.time()

        def progress(actor_id: str) -> tuple:
            if actor_id not in clocks:
                return NO_PROGRESS
            generation, first, began = clocks[actor_id]
            return generation, first + max(0, int((epoch - began) / step_s)), 0, compute, 0

        failed = sum(not sender.beat(actor_id, progress(actor_id)) for actor_id in beating)
        # a worker's gap between two beats: from its place in one round to its place in the next, at
        # most from the previous round's start to this one's end (a starved round takes long to send)
        longest_gap.value = max(longest_gap.value, time.monotonic() - previous_start)
        if failed:  # said, not swallowed: a beat lost here looks like a silent worker there
            refused.value += failed
        time.sleep(max(0.0, last + HEARTBEAT_EVERY_S - time.monotonic()))
