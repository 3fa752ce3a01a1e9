"""The torchft peer of `bench recovery --against torchft`: its supervisor, lighthouse and replica
groups on this machine, a group killed and started again. Oracles: torchft's own commits (the
survivor commits every step once; the restarted group ends in the survivor's
quorum at the last step), and the bench's one-line refusals."""

import pytest

from elastic_zero.bench.torchft_job import MISSING, torchft_installed

needs_torchft = pytest.mark.skipif(not torchft_installed(), reason=MISSING)


@pytest.mark.unit
def test_an_unknown_peer_or_a_missing_torchft_is_one_line(monkeypatch):
    from elastic_zero.bench import recovery, torchft_job

    with pytest.raises(ValueError, match=r"--against: got 'nope'; allowed: ray-train, torchft"):
        recovery.run_recovery_bench(against="nope")
    monkeypatch.setattr(torchft_job, "torchft_installed", lambda: False)
    with pytest.raises(ValueError, match=r"--against torchft: torchft is not installed: pip install -e '\.\[anchors\]'"):
        recovery.run_recovery_bench(against="torchft")


@needs_torchft
@pytest.mark.runtime
@pytest.mark.slow
def test_a_killed_replica_group_is_started_again_and_heals_from_a_live_peer(tmp_path):
    from elastic_zero.bench.torchft_job import run_torchft

    marker = tmp_path / "killed"
    steps = 60  # the survivor must still be training when the restarted group (seconds to start) joins
    config = {"preset": "gpt-tiny", "steps": steps, "kill_step": 4, "micro_batch": 2, "global_batch": 4,
              "marker": str(marker)}
    lines = run_torchft(config, 2, str(tmp_path / "run"), timeout_s=300)
    killed_at = float(marker.read_text())
    committed = {g: [r for r in lines if r["group"] == g and r["committed"]] for g in (0, 1)}
    # the survivor reached the end, one step at a time
    assert [r["step"] for r in committed[0]] == list(range(steps)), [r["step"] for r in committed[0]]
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

    from elastic_zero.bench.torchft_job import run_torchft

    config = {"preset": "no-such-preset", "steps": 4, "kill_step": 2, "micro_batch": 2, "global_batch": 4,
              "marker": str(tmp_path / "killed")}
    with pytest.raises(RuntimeError, match=r"torchft replica group \d exited with 1: .*unknown model preset"):
        run_torchft(config, 2, str(tmp_path / "run"), timeout_s=120)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout.split()
    assert left == []  # no replica group left running (their command lines name the run's config)
