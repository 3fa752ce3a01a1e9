"""Sharded checkpoints: written by 4 real ranks, read at any world size and stage."""

import pyarrow.fs as pafs
import pytest
import torch

from elastic_zero.checkpoint import (
    ChecksumError, commit, export_state_dict, list_checkpoints, load_latest, load_shard, make_manifest,
    open_store, read_manifest, resolve, save, shards_from_state_dict, write_rank_file,
)
from elastic_zero.testing.local_group import run_local_group
from elastic_zero.models import build_preset
from elastic_zero.zero import SGD, ZeroEngine, reshard
from engine_cases import difference, make_engine, oracle, run_steps, shards_at

CASE, FIRST, TOTAL = "adamw", 3, 6
BLOCK = 5000  # small blocks, so ranges span several


def _train_and_write(ctx, root):
    engine = make_engine(ctx.process_group, ctx.rank, CASE, 2)
    run_steps(engine, ctx.rank, ctx.world_size, CASE, 0, FIRST)
    state = engine.shard_state()
    fs, path = open_store(root)
    entry = write_rank_file(fs, f"{path}/step-{FIRST:010d}", state, BLOCK)  # every rank writes its own file
    return state, entry


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = run_local_group(_train_and_write, 4, (root,), timeout_s=120)
    states = [s for s, _ in out]
    fs, path = open_store(root)
    commit(fs, path, make_manifest(states[0], [e for _, e in out], stage=2, extra={"cursor": FIRST * 24}))
    return root, states


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])  # 4: the saved size, every block read straight into place
def test_load_at_another_world_size_is_bit_identical(saved, world):
    root, states = saved
    fs, path = open_store(root)
    directory = resolve(fs, path, "latest")
    want = reshard(states, world)
    for rank in range(world):
        got = load_shard(fs, directory, states[0].layout, world, rank)
        assert got.scalars["step"] == FIRST
        for name, vec in want[rank].vectors.items():
            assert torch.equal(got.vectors[name], vec), (world, rank, name)
    manifest = read_manifest(fs, directory)
    assert manifest.world_size == 4 and manifest.extra["cursor"] == 72 and len(manifest.files) == 4


@pytest.mark.parametrize("threads", [1, 3])
def test_a_restore_reads_each_block_once_on_any_number_of_threads(saved, threads):
    from elastic_zero.checkpoint.block_reads import read_ranges

    root, states = saved
    fs, path = open_store(root)
    directory = resolve(fs, path, "latest")
    manifest = read_manifest(fs, directory)
    mine = states[1]  # rank 1 of the 4 that saved: its ranges are its own file's blocks, whole
    ranges = mine.partition.ranges(1)
    got = {name: torch.empty_like(v) for name, v in mine.vectors.items()}
    wanted, cursor = [], 0
    for r in ranges:
        wanted += [(name, r.start, r.stop, got[name][cursor : cursor + r.numel]) for name in got if r.numel]
        cursor += r.numel
    assert read_ranges(fs, directory, manifest, wanted, threads=threads) == mine.nbytes()
    assert all(torch.equal(got[name], v) for name, v in mine.vectors.items())


def test_a_buffer_of_the_wrong_kind_is_the_readers_error_not_a_damaged_checkpoint(saved):
    from elastic_zero.checkpoint.block_reads import read_ranges

    root, states = saved
    fs, path = open_store(root)
    directory = resolve(fs, path, "latest")
    name = sorted(states[0].vectors)[0]
    r = next(r for r in states[0].partition.ranges(0) if r.numel)
    for wrong in (torch.empty(r.numel, dtype=torch.float64), torch.empty(2 * r.numel)[::2]):
        with pytest.raises(ValueError, match=rf"read_ranges: '{name}' \[{r.start}, {r.stop}\) wants a contiguous"):
            read_ranges(fs, directory, read_manifest(fs, directory), [(name, r.start, r.stop, wrong)])


def _resume_at_two(ctx, root):
    engine = make_engine(ctx.process_group, ctx.rank, CASE, 3, seed=99)  # another stage, other weights
    fs, path = open_store(root)
    engine.load_shard_state(load_shard(fs, resolve(fs, path), engine.layout, 2, ctx.rank))
    run_steps(engine, ctx.rank, 2, CASE, FIRST, TOTAL)
    return engine.full_state_dict()


def test_training_resumed_at_two_ranks_and_stage_3_matches_an_uninterrupted_run(saved):
    root, _ = saved
    state = run_local_group(_resume_at_two, 2, (root,), timeout_s=120)[0]
    assert difference(CASE, oracle(CASE, TOTAL), state) <= 1e-5


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    save(str(tmp_path), shards_at(1, 3), stage=1, block_numel=BLOCK)
    fs, root = open_store(str(tmp_path))
    half = shards_at(2, 3, seed=1)
    write_rank_file(fs, f"{root}/step-{2:010d}", half[0], BLOCK)  # the process died before the others and the commit
    assert [s for s, _ in list_checkpoints(fs, root)] == [1]
    assert resolve(fs, root).endswith("step-0000000001")
    layout = half[0].layout
    got, _ = load_latest(fs, root, layout, 1, 0)
    assert got.scalars["step"] == 1


def test_corruption_is_named_and_latest_falls_back(tmp_path):
    fs, root = open_store(str(tmp_path))
    save(str(tmp_path), shards_at(1, 3), stage=1, block_numel=BLOCK)
    newest = save(str(tmp_path), shards_at(2, 3, seed=1), stage=1, block_numel=BLOCK)
    layout = shards_at(0, 3)[0].layout
    path = f"{newest}/rank-00001.bin"
    with open(path, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match=r"rank-00001.bin: checksum mismatch in '\w+' elements \[\d+, \d+\)"):
        load_shard(fs, newest, layout, 2, 0)
    # rank 1 of 2 needs none of the damaged block: range reads never touch it
    assert load_shard(fs, newest, layout, 2, 1).scalars["step"] == 2
    with pytest.warns(UserWarning, match="is damaged"):
        got, used = load_latest(fs, root, layout, 2, 0)
    assert used.endswith("step-0000000001") and got.scalars["step"] == 1
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ChecksumError, match="truncated"):
        load_shard(fs, newest, layout, 1, 0)


def test_retention_layout_mismatch_and_an_object_store_fake(tmp_path):
    for step in (1, 2, 3, 4):
        save(str(tmp_path), shards_at(step, 3), stage=1, keep=2)
    fs, root = open_store(str(tmp_path))
    assert [s for s, _ in list_checkpoints(fs, root)] == [3, 4]
    other = ZeroEngine(build_preset("gpt-tiny", seed=0, n_layer=1), SGD(lr=0.1), stage=1)
    with pytest.raises(ValueError, match="layout does not match the model: .*blocks.1"):
        load_shard(fs, resolve(fs, root), other.layout, 1, 0)
    # pyarrow's SubTreeFileSystem stands in for object storage: keys under a bucket prefix
    bucket = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    shards = shards_at(7, 3)
    save("bucket/run", shards, stage=1, filesystem=bucket)
    fs2, root2 = open_store("bucket/run", bucket)
    got = load_shard(fs2, resolve(fs2, root2), shards[0].layout, 3, 2)
    assert torch.equal(got.vectors["params"], shards[2].vectors["params"])


def test_export_to_and_import_from_a_plain_state_dict(tmp_path):
    engine = ZeroEngine(build_preset("gpt-tiny", seed=3), SGD(lr=0.1, momentum=0.9), stage=3)
    shard = engine.shard_state()
    save(str(tmp_path / "c"), reshard([shard], 2), stage=3)
    fs, root = open_store(str(tmp_path / "c"))
    exported = export_state_dict(fs, resolve(fs, root))
    torch.save(exported, tmp_path / "w.pt")
    plain = torch.load(tmp_path / "w.pt", weights_only=True)
    full = engine.full_state_dict()
    assert plain.keys() == full.keys() and all(torch.equal(plain[k], full[k]) for k in full)
    fresh = ZeroEngine(build_preset("gpt-tiny", seed=9), SGD(lr=0.1, momentum=0.9), stage=2)
    (mine,) = shards_from_state_dict(plain, fresh.layout, 1, fresh.vector_names())
    fresh.load_shard_state(mine)
    assert all(torch.equal(fresh.full_state_dict()[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="state dict does not fit the model: missing \\['wte.weight', 'wpe.weight'"):
        shards_from_state_dict({}, fresh.layout, 1, fresh.vector_names())


KILL_MIDWAY = """
import os, signal, sys
import elastic_zero.checkpoint.store as store
from engine_cases import make_engine
from elastic_zero.zero import reshard

real = store.write_rank_file
written = []

def write_then_die(fs, directory, state, block_numel=store.BLOCK_NUMEL):
    if written:  # the second rank's file: the process is killed in the middle of the save
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(real(fs, directory, state, block_numel))
    return written[-1]

store.write_rank_file = write_then_die
shards = reshard([make_engine(None, 0, "sgd", 2).shard_state()], 3)
for s in shards:
    s.scalars["step"] = 9
store.save(sys.argv[1], shards, stage=2)
"""


def test_a_process_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    import os
    import subprocess
    import sys

    save(str(tmp_path), shards_at(4, 3), stage=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.getcwd()])}
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, str(tmp_path)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL
    assert (tmp_path / "step-0000000009" / "rank-00000.bin").exists()  # half written
    fs, root = open_store(str(tmp_path))
    assert [s for s, _ in list_checkpoints(fs, root)] == [4]  # and invisible
    got, used = load_latest(fs, root, shards_at(0, 3)[0].layout, 2, 1)
    assert used.endswith("step-0000000004") and got.scalars["step"] == 4
