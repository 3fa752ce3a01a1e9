"""`elastic-zero bench status`: what `status` costs a client that has only the dashboard's address.

A real Ray head on this machine (`ray start --head`, token auth on), a paced gpt-tiny job submitted
to it, then rounds side by side, each in turn:

  published        Client.published_status(): the record the coordinator last wrote (each second
                   for this job), found and read through the dashboard (two HTTP requests)
  control_job      Client.status(live=True): the coordinator asked now, through a control job
  cli              `elastic-zero status JOB --json`, a fresh process as a user runs it (the published record)
  cli_live         `elastic-zero status JOB --json --live` (a control job)

Medians in seconds; the figures are this machine's (a client on the head's own machine).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

WAYS = ("published", "control_job", "cli", "cli_live")


def _spec() -> str:
    return textwrap.dedent("""\
        name = "bench-status"
        [model]
        preset = "gpt-tiny"
        [train]
        loss = "paced:loss"
        steps = 1000000
        global_batch = 8
        micro_batch = 4
        [elastic]
        workers = 2
        min_workers = 1
        max_workers = 2
        """)


_PACED = textwrap.dedent("""\
    import time

    from elastic_zero.losses import next_token_loss


    def loss(model, batch):  # paced, so that the job leaves the cores to what is measured
        time.sleep(0.2)
        return next_token_loss(model, batch)
    """)


def run_status_bench(rounds: int = 5) -> dict:
    if rounds < 1:
        raise ValueError(f"bench status: --rounds must be >= 1, got {rounds}")
    from elastic_zero.testing.local_cluster import RayHead

    work = tempfile.mkdtemp(prefix="ez-bench-status-")
    head = RayHead(auth=True, num_cpus=4)
    try:
        env = head.client_env()
        with open(os.path.join(work, "job.toml"), "w") as fh:
            fh.write(_spec())
        with open(os.path.join(work, "paced.py"), "w") as fh:
            fh.write(_PACED)

        def cli(*args: str) -> str:
            done = subprocess.run([sys.executable, "-m", "elastic_zero.cli", *args, "--address", head.address],
                                  cwd=work, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"elastic-zero {' '.join(args)}: {done.stderr.strip()[-500:]}")
            return done.stdout

        job_id = cli("submit", "job.toml").strip()
        deadline = time.monotonic() + 300
        while (record := head.job_status(job_id)) is None or record["step"] < 3:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench status: job {job_id} did not train within 300 s: {record}")
            time.sleep(1)
        probe = textwrap.dedent(f"""\
            import json, time, elastic_zero as ez
            client, times = ez.Client({head.address!r}), {{"published": [], "control_job": []}}
            for _ in range({rounds}):
                for way, ask in (("published", lambda: client.published_status({job_id!r})),
                                 ("control_job", lambda: client.status({job_id!r}, live=True))):
                    t = time.perf_counter()
                    if ask() is None:
                        raise SystemExit(way + ": no record")
                    times[way].append(time.perf_counter() - t)
            print(json.dumps(times))
            """)
        done = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"bench status: the in-process client failed: {done.stderr.strip()[-500:]}")
        times = {**json.loads(done.stdout.strip().splitlines()[-1]), "cli": [], "cli_live": []}
        for _ in range(rounds):
            for way, args in (("cli", ()), ("cli_live", ("--live",))):
                t = time.perf_counter()
                cli("status", job_id, "--json", *args)
                times[way].append(time.perf_counter() - t)
        cli("stop", job_id)
        return {"rounds": rounds, "seconds": {w: [round(t, 4) for t in times[w]] for w in WAYS},
                "median_s": {w: round(statistics.median(times[w]), 4) for w in WAYS}}
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)


def format_status_bench(report: dict) -> str:
    m = report["median_s"]
    return "\n".join([
        f"bench status: a token-auth Ray head on this machine, {report['rounds']} rounds each, medians",
        f"  in the client's process:  published record {m['published'] * 1000:8.1f} ms   "
        f"control job {m['control_job'] * 1000:8.1f} ms   ({m['control_job'] / m['published']:.0f}x)",
        f"  `elastic-zero status`:    published record {m['cli']:8.2f} s    "
        f"--live      {m['cli_live']:8.2f} s    ({m['cli_live'] / m['cli']:.1f}x)",
    ])
