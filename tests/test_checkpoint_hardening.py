"""Checkpoints that cannot be lost or lie: immutable commits, pruning by commit order, stores
that cannot be read or written, one restore path, an abandon that returns at once, names that
cannot leave the root. Oracle: the bytes and the shards that were saved."""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

import elastic_zero.checkpoint.writer as writer_module
from elastic_zero.testing.local_group import run_local_group
from elastic_zero.checkpoint import (
    StoreError, commit, list_checkpoints, open_store, probe_writable, read_manifest, resolve, restore_shard, save,
)
from elastic_zero.checkpoint.manifest import Manifest
from elastic_zero.checkpoint.writer import AsyncCheckpointWriter
from elastic_zero.models import build_preset
from elastic_zero.job.spec import SpecError, spec_from_dict
from elastic_zero.zero import SGD, TorchComm, ZeroEngine
from engine_cases import shards_at

pytestmark = pytest.mark.unit


def _bytes_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_rank_file_is_written_from_views_of_the_snapshot_not_from_copies():
    """A save writes on a thread beside training: a copy of each block into a bytes object would hold
    the GIL for its whole length (a GIL-bound thread beside such copies made no progress at all,
    measured), where the stream's write and the CRC take a view with it released."""
    from elastic_zero.checkpoint.store import _raw_bytes

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        vector = torch.arange(10, dtype=dtype)
        raw = _raw_bytes(vector[2:6])
        assert raw.nbytes == 4 * vector.element_size() and raw.format == "B"
        vector[3] = 100  # written after the view was taken: the view shows it, a copy would not
        bits = torch.int16 if vector.element_size() == 2 else torch.int32
        assert bytes(raw) == vector[2:6].view(bits).numpy().tobytes()


def test_a_committed_step_is_never_rewritten(tmp_path):
    """Seen before: a replay (or a resume at an older step) rewrote the data files inside an
    already committed step directory."""
    first = save(str(tmp_path), shards_at(5, 2), stage=1)
    before = _bytes_of(tmp_path / "step-0000000005")
    again = save(str(tmp_path), shards_at(5, 2, seed=1), stage=1)  # the same step from another trajectory
    assert first.endswith("step-0000000005") and again.endswith("step-0000000005-1")
    assert _bytes_of(tmp_path / "step-0000000005") == before
    fs, root = open_store(str(tmp_path))
    assert resolve(fs, root) == again and resolve(fs, root, "5") == again
    manifest = read_manifest(fs, first)
    with pytest.raises(StoreError, match="already committed"):
        commit(fs, root, manifest, directory=first)


def test_pruning_follows_commit_order_and_keeps_the_newest_commit(tmp_path):
    """A resume from an older step commits a lower step than the ones before it: pruning by step
    number deleted the checkpoint just committed."""
    for step in (20, 30):
        save(str(tmp_path), shards_at(step, 2), stage=1, keep=1)
    time.sleep(0.01)  # commit order is the manifests' time
    newest = save(str(tmp_path), shards_at(25, 2), stage=1, keep=1)
    fs, root = open_store(str(tmp_path))
    assert list_checkpoints(fs, root) == [(25, newest)]
    assert resolve(fs, root) == newest


def test_a_jobs_own_commits_are_those_made_since_it_started(tmp_path):
    """What the coordinator looks for when no note told it of a commit (rank 0 killed just after
    committing): this job's commits, never an earlier job's in the same store."""
    from elastic_zero.checkpoint import committed_since

    earlier = save(str(tmp_path), shards_at(5, 2), stage=1)
    time.sleep(0.05)
    started = time.time()
    assert committed_since(*open_store(str(tmp_path)), started) == []
    own = save(str(tmp_path), shards_at(10, 2), stage=1)
    (tmp_path / "step-0000000015").mkdir()  # written, never committed
    assert committed_since(*open_store(str(tmp_path)), started) == [own]
    assert sorted(committed_since(*open_store(str(tmp_path)), 0.0)) == sorted([earlier, own])
    assert committed_since(*open_store(str(tmp_path / "none-yet")), started) == []


def test_an_unreadable_or_unwritable_store_is_an_error_naming_the_uri(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    fs, root = open_store(str(blocker))
    with pytest.raises(StoreError, match=r"checkpoint.uri: cannot read .*a-file"):
        list_checkpoints(fs, root)  # seen before: [] and a silent fresh start for resume = "latest"
    with pytest.raises(StoreError, match=r"checkpoint.uri: cannot write to .*a-file/ck"):
        probe_writable(str(blocker / "ck"))
    fs, root = open_store(str(tmp_path / "not-yet"))
    assert list_checkpoints(fs, root) == []  # a store that does not exist yet holds nothing


def test_names_that_would_leave_the_checkpoint_root_are_refused(tmp_path):
    directory = save(str(tmp_path), shards_at(3, 2), stage=1)
    fs, root = open_store(str(tmp_path))
    data = json.loads((tmp_path / "step-0000000003" / "manifest.json").read_text())
    data["files"][0]["path"] = "../../outside.bin"
    with pytest.raises(ValueError, match="not a plain file name"):
        Manifest.from_dict(data)
    for bad in ("../step-0000000003", "/etc", "step-3/../../x", f"{root}/../elsewhere"):
        with pytest.raises(ValueError, match="expected 'latest', a step number or a step directory"):
            resolve(fs, root, bad)
    assert resolve(fs, root, "step-0000000003") == directory == resolve(fs, root, directory)
    with pytest.raises(SpecError, match="checkpoint.resume: must be 'latest', a step number"):
        spec_from_dict({"checkpoint": {"uri": str(tmp_path), "resume": "../other-job"}})


def test_abandon_returns_at_once_even_during_a_slow_write(tmp_path, monkeypatch):
    """Seen before: on a failure abandon() joined the background write, and a survivor busy in a
    slow write missed the coordinator's deadline and was killed as unresponsive."""
    release = threading.Event()
    real_write = writer_module.write_rank_file

    def slow_write(*args, **kwargs):
        release.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_rank_file", slow_write)
    store = dist.HashStore()
    writer = AsyncCheckpointWriter(str(tmp_path), store, keep=2, stage=1)
    shard = shards_at(4, 1)[0]
    writer.save(shard, "g0-s4", {})
    started = time.perf_counter()
    writer.abandon()
    assert time.perf_counter() - started < 0.05
    release.set()
    writer.wait()
    assert writer.take_errors() == ["g0-s4: not committed: the generation failed before the commit"]
    fs, root = open_store(str(tmp_path))
    assert list_checkpoints(fs, root) == []  # an abandoned save never commits
    # a rank waiting for a peer's post that will never come leaves as soon as it is abandoned
    waiting = AsyncCheckpointWriter(str(tmp_path), dist.HashStore(), keep=2, stage=1)
    waiting.save(shards_at(4, 2)[1], "g1-s4", {})
    waiting.abandon()
    waiting.wait()
    assert waiting.take_errors() == ["g1-s4: not committed: the generation failed before every rank posted its part"]


def test_rank_0_waits_for_a_slow_peers_part_without_torchs_timeout_warnings(tmp_path, capfd):
    """Rank 0 commits once every rank posted its part. It waited in the store with 0.2 s timeouts, and
    torch's client logged two warning lines for each one that ran out ("waitForInput ... timed out"):
    hundreds a save behind a slow peer, in the job's output. Oracle: the commit of both parts."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = AsyncCheckpointWriter(str(tmp_path), dist.TCPStore("127.0.0.1", server.port, is_master=False), keep=2, stage=1)
    second = AsyncCheckpointWriter(str(tmp_path), dist.TCPStore("127.0.0.1", server.port, is_master=False), keep=2,
                                   stage=1)
    shards = shards_at(4, 2)
    first.save(shards[0], "g0-s4", {})
    time.sleep(0.7)  # the peer slow to post: rank 0 waits through several of the old timeouts
    second.save(shards[1], "g0-s4", {})
    first.wait()
    second.wait()
    assert first.take_errors() == [] and len(first.take_committed()) == 1
    assert "waitForInput" not in capfd.readouterr().err


def test_a_failed_write_is_reported_and_the_next_save_commits(tmp_path):
    (tmp_path / "step-0000000002").write_text("a file where the step's directory goes")
    writer = AsyncCheckpointWriter(str(tmp_path), dist.HashStore(), keep=2, stage=1)
    for step in (2, 3):
        writer.save(shards_at(step, 1)[0], f"g0-s{step}", {})
        writer.wait()
    (error,) = writer.take_errors()
    assert error.startswith("g0-s2: ") and "step-0000000002" in error
    assert [d.rsplit("/", 1)[1] for d in writer.take_committed()] == ["step-0000000003"]


def _restore_two(ctx, candidates, layout_seed):
    engine = ZeroEngine(build_preset("gpt-tiny", seed=layout_seed), SGD(lr=0.1, momentum=0.9), stage=1)
    fs, _ = open_store(candidates[0].rsplit("/", 1)[0])
    state, used = restore_shard(fs, candidates, engine.layout, 2, ctx.rank, engine.vector_names(),
                                TorchComm(ctx.process_group), torch.device("cpu"))
    return used, state.vectors["params"]


def test_every_rank_restores_the_same_checkpoint_passing_over_a_damaged_one(tmp_path):
    """The one restore path of resume and recovery: the newest commit is damaged only in rank 0's
    range, so rank 1 could read it; both must go back to the one before together."""
    good = save(str(tmp_path), shards_at(1, 2), stage=1, block_numel=4096)
    bad = save(str(tmp_path), shards_at(2, 2, seed=1), stage=1, block_numel=4096)
    with open(f"{bad}/rank-00000.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = run_local_group(_restore_two, 2, ([bad, good], 0), timeout_s=120)
    assert [used for used, _ in out] == [good, good]
    expected = shards_at(1, 2)
    for rank, (_, params) in enumerate(out):
        assert torch.equal(params, expected[rank].vectors["params"])
