"""The command line end to end: the README's main job (small) and the step benchmark's JSON."""

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "elastic_zero.cli"]


def _run(*args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_run_trains_and_the_loss_falls():
    out = _run("run", "--preset", "gpt-tiny", "--steps", "12", "--global-batch", "8", "--micro-batch", "2")
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 12 steps on 2 ranks, ZeRO stage 2")
    first_loss, final_loss = (float(v) for v in last.split("loss ")[1].split(" in ")[0].split(" -> "))
    assert final_loss < first_loss


def test_bench_step_json_reports_the_contract_fields():
    out = _run("bench", "step", "--stage", "2", "--workers", "2", "--preset", "gpt-tiny",
               "--steps", "2", "--warmup", "1", "--rounds", "1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in ("stage", "workers", "median_step_s", "ddp_median_step_s", "ratio_vs_ddp",
                "optimizer_bytes_per_rank", "optimizer_bytes_theory"):
        assert key in report, key
    assert report["stage"] == "2" and report["workers"] == 2
    assert report["ratio_vs_ddp"] == pytest.approx(report["median_step_s"] / report["ddp_median_step_s"])
    assert 1.0 <= report["optimizer_bytes_per_rank"] / report["optimizer_bytes_theory"] <= 1.02


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "--preset", "gpt-huge"), "unknown preset 'gpt-huge'"),
        (("run", "--global-batch", "15"), "global batch 15 must divide evenly over 2 workers"),
        (("bench", "step", "--stage", "2", "--steps", "1", "--rounds", "3"), "steps >= rounds"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    out = _run(*args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
