"""`bench control-plane`'s table (control_plane.py measures): the coordinator's own share first, the
harness's beside it, then the goals at the largest size, where the CPU went, and where beats were lost."""

from __future__ import annotations

import os

# the headline: the coordinator's own share (its CPU in each window, beyond its steady state); the
# wall times beside it count the simulated workers too, which share this machine's cores with it
GOALS = {"steady_control_cpu": (0.05, "at most 5% of a core, the coordinator and its listener's drain together"),
         "detect_s": (1.0, "within 1 s"),
         "recovery_coordinator_cpu_s": (1.0, "at most 1 s of its own CPU from the freeze to the plans held"),
         "joiners_coordinator_cpu_s": (1.0, "at most 1 s of its own CPU from the request to the 64 admitted"),
         "rendezvous_s": (2.0, "at most 2 s"), "peak_rss_mb": (1024.0, "at most 1 GB"), "status_s": (1.0, "within 1 s")}


def _harness(window: str):
    return lambda r: (r.get(window) or {}).get("simulated_workers_cpu_s")


def format_control_plane(report: dict) -> str:
    cols = [("workers", "N"), ("steady_cpu", "cpu/core"), ("steady_listener_cpu", "(listener)"), ("detect_s", "detect s"),
            ("recovery_coordinator_cpu_s", "loss: coord s"), (_harness("recovery_window"), "(harness s)"),
            ("survivors_hold_plan_s", "(held wall s)"),
            ("joiners_coordinator_cpu_s", "64 in: coord s"), (_harness("scale_up_window"), "(harness s)"),
            ("joiners_admitted_s", "(admitted s)"),
            ("rendezvous_s", "rendezvous s"), ("rendezvous_after_last_s", "(after last s)"), ("peak_rss_mb", "peak RSS MB"),
            ("events_bytes", "events B"),
            ("status_s", "status s"), ("stop_s", "stop s")]
    lines = [f"control plane: simulated workers, {report['per_node']} a node, steady state {report['steady_s']:g} s, "
             f"step {report['step_s']:g} s. coord s: the coordinator's own CPU, beyond its steady state, from a "
             f"node's freeze until every survivor held its plan (loss), and from a scale request until the 64 "
             f"joiners held theirs (64 in); harness s: the simulated workers' CPU in the same window, on the same "
             f"{os.cpu_count()} cores; the wall times of those windows count both; rendezvous s: the first generation's, "
             f"from the first rank's start to the last one done (after last s: from the last rank's start)",
             "  " + "  ".join(f"{title:>14}" for _, title in cols)]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"  {r['workers']:>14}  failed: {r['error']}")
            continue
        lines.append("  " + "  ".join(f"{_cell(k(r) if callable(k) else r.get(k)):>14}" for k, _ in cols))
    largest = report["rows"][-1]
    for key, (limit, text) in GOALS.items():
        value = largest.get(key)
        verdict = "met" if value is not None and value <= limit else "MISSED"
        lines.append(f"  goal at {largest['workers']}: {key} {text}: {_cell(value)} {verdict}")
    for key, what in (("recovery_window", "from the freeze until every survivor held its plan"),
                      ("scale_up_window", "from the scale request until the 64 joiners held their plan")):
        w = largest.get(key)
        if w:
            lines.append(f"  CPU at {largest['workers']}, {what} ({w['wall_s']:g} s; {os.cpu_count()} cores: "
                         f"{os.cpu_count() * w['wall_s']:.1f} CPU s): the coordinator {w['coordinator_cpu_s']:g} "
                         f"beyond its steady state, its relay {w['relay_cpu_s']:g}, its heartbeat listener's drain "
                         f"{w.get('listener_cpu_s', 0):g}, the simulated workers "
                         f"{w['simulated_workers_cpu_s']:g} (steady: {largest['steady_hosts_cpu']:g} per s)")
    for r in report["rows"]:
        if "lost_to_silence" in r:
            drops = r.get("kernel_drops") or {}
            lines.append(f"  beats at {r['workers']}: {r['lost_to_silence']} workers lost to silence in "
                         f"{r['silence_decisions']} decisions (the scenario freezes one node); the listener counted "
                         f"{r['beats_dropped']} dropped; the machine's drops: input queues {drops.get('backlog')}, "
                         f"UDP receive buffers {drops.get('rcvbuf_errors')}; sends refused "
                         f"{r['sim_beats_refused']}; the simulated beats' longest gap {_cell(r.get('sim_longest_beat_gap_s'))} s "
                         f"(past the timeout, a silence is the harness's), the listener's drain's longest pause "
                         f"{_cell(r.get('listener_longest_pause_s'))} s at niceness {_cell(r.get('listener_nice'))}")
    real = report.get("real_jobs")
    if real:
        cpu = ", ".join(f"{n} workers {v:g}" for n, v in real["coordinator_cpu"].items())
        lines.append(f"  real gpt-tiny jobs, the coordinator's CPU over {real['sample_s']:g} s of steady training: "
                     f"{cpu}; "
                     f"{_cell(real['us_per_s_per_added_worker'])} us/s per added worker (goal at most 50)")
    grown = {k: v for k, v in report["growth_vs_linear"].items() if v is not None}
    lines.append("  growth from smallest to largest, against linear (<= 1: linear or slower): "
                 + ", ".join(f"{k} {v:g}" for k, v in grown.items()))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)
