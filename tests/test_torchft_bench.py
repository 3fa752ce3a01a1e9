"""The torchft peer of `bench recovery --against torchft`: its supervisor, lighthouse and replica
groups on this machine, a group killed and started again. Oracles: torchft's own commits (the
survivor commits every step once; the restarted group ends in the survivor's
quorum at the last step), and the bench's one-line refusals."""

import pytest

from elastic_zero.bench.torchft_cluster import MISSING, torchft_installed

needs_torchft = pytest.mark.skipif(not torchft_installed(), reason=MISSING)


@pytest.mark.unit
def test_an_unknown_peer_or_a_missing_torchft_is_one_line(monkeypatch):
    from elastic_zero.bench import recovery, torchft_cluster

    with pytest.raises(ValueError, match=r"--against: got 'nope'; allowed: ray-train, torchft"):
        recovery.run_recovery_bench(against="nope")
    monkeypatch.setattr(torchft_cluster, "torchft_installed", lambda: False)
    with pytest.raises(ValueError, match=r"--against torchft: torchft is not installed: pip install -e '\.\[anchors\]'"):
        recovery.run_recovery_bench(against="torchft")


@needs_torchft
@pytest.mark.runtime
@pytest.mark.slow
def test_a_killed_replica_group_is_started_again_and_heals_from_a_live_peer(tmp_path):
    from elastic_zero.bench.recovery import run_torchft

    marker = tmp_path / "killed"
    # the survivor must still be training when the restarted group (seconds to start) joins: gpt-tiny's
    # 10 ms steps were all done before (seen: 60 steps in 0.43 s), gpt-small's take about 0.3 s
    steps = 40
    config = {"preset": "gpt-small", "steps": steps, "kill_step": 4, "micro_batch": 2, "global_batch": 4,
              "marker": str(marker)}
    lines = run_torchft(config, 2, str(tmp_path / "run"), timeout_s=300)
    killed_at = float(marker.read_text())
    committed = {g: [r for r in lines if r["group"] == g and r["committed"]] for g in (0, 1)}
    # the survivor reached the end, one step at a time from the step it first joined at (the groups
    # start side by side, and the first quorum may form without it: it then heals from the other)
    survived = [r["step"] for r in committed[0]]
    assert survived == list(range(survived[0], steps)) and survived[0] < 4, survived
    before = [r for r in committed[1] if r["done"] < killed_at]
    after = [r for r in committed[1] if r["done"] > killed_at]
    assert before and after and before[-1]["step"] >= 3
    assert len({r["attempt"] for r in after}) == 1 and after[0]["attempt"] != before[0]["attempt"]  # started again
    # it ends with the survivor, in one quorum, at the last step (healed from it whenever it joined)
    assert after[-1]["step"] == steps - 1 and after[-1]["participants"] == 2 == committed[0][-1]["participants"]
    assert max(r.get("state_bytes", 0) for r in lines) > 0


@needs_torchft
@pytest.mark.runtime
def test_a_replica_group_that_fails_is_named_with_its_last_words_and_everything_stops(tmp_path):
    import subprocess

    from elastic_zero.bench.recovery import run_torchft

    config = {"preset": "no-such-preset", "steps": 4, "kill_step": 2, "micro_batch": 2, "global_batch": 4,
              "marker": str(tmp_path / "killed")}
    with pytest.raises(RuntimeError, match=r"torchft replica group \d exited with 1: .*unknown model preset"):
        run_torchft(config, 2, str(tmp_path / "run"), timeout_s=120)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout.split()
    assert left == []  # no replica group left running (their command lines name the run's config)


@needs_torchft
@pytest.mark.runtime
@pytest.mark.slow
def test_torchft_rides_out_the_goodput_schedule_by_healing_from_live_groups(tmp_path):
    import glob
    import json

    from elastic_zero.bench.goodput import run_goodput_bench

    report = run_goodput_bench(window_s=65, seed=1, notice_s=5, systems=("torchft",), work_root=str(tmp_path),
                               clock="first_step")
    r = report["torchft"]
    assert r["rc"] == 0 and r["error"] is None, r
    assert [p["action"] for p in r["played"]] == [e["action"] for e in report["schedule"]]
    # the frozen node's survivors went on: no group failed (a failed all-reduce only discards its step)
    assert r["restarts"] == 0 and r["groups_started"] == 8  # a, b, then a2 and c
    # 4 groups, 2 after the freeze, 4 with a2, 2 after b's preemption, 4 with c (3 while one heals)
    sizes = [size for _, size in r["world_sizes"]]
    settled = [size for size in sizes[sizes.index(4):] if size in (2, 4)]
    assert [s for i, s in enumerate(settled) if i == 0 or settled[i - 1] != s] == [4, 2, 4, 2, 4], r["world_sizes"]
    # every step once, in order, never back at step 0: new groups healed from live ones
    (log,) = glob.glob(str(tmp_path / "ez-goodput-torchft-*" / "torchft_steps.jsonl"))
    records = [json.loads(line) for line in open(log)]
    kept = sorted({x["step"] for x in records if x["committed"] and x["participating"]})
    assert kept == list(range(r["steps_kept"])) and r["steps_kept"] > 20
    # the lost groups' shares are dropped, as torchft does; the kept ones are whole shares
    assert r["skipped_samples"] > 0 and r["samples_kept"] % 4 == 0
    assert 0 < r["goodput"] <= 1
