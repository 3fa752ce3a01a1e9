"""Weights out of a sharded checkpoint, one tensor at a time: safetensors, a Hugging Face directory,
a torch state dict. Oracle: the model the checkpoint was saved from (its state dict, its logits)."""

import json
import os

import pyarrow.fs as pafs
import pytest
import torch

from elastic_zero.checkpoint import save, shards_from_state_dict
from elastic_zero.checkpoint.export import export, load_state_dict, model_extra
from elastic_zero.plan.layout import build_layout
from elastic_zero.zero.units import find_units, param_specs

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()  # its LM head is tied to the embedding


def _save(model, root, world_size=3, block_numel=100):
    """A checkpoint of `model` as the workers write it: `world_size` ranks' files, the manifest's
    extra with what export needs (model_extra)."""
    layout = build_layout([s for s, _ in param_specs(model, find_units(model))])
    shards = shards_from_state_dict(dict(model.named_parameters()), layout, world_size, ["params", "exp_avg"], step=7)
    return save(str(root), shards, stage=3, extra=model_extra(model), block_numel=block_numel)


def test_a_hugging_face_directory_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    model = _gpt2()
    directory = _save(model, tmp_path / "ckpt")
    (written,) = export(directory, str(tmp_path / "hf"), "hf")
    assert sorted(os.listdir(written)) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, loaded(tokens).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied


def test_past_the_shard_size_the_directory_has_an_index_and_still_loads(tmp_path):
    model = _gpt2(seed=1)
    directory = _save(model, tmp_path / "ckpt", world_size=2)
    (written,) = export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), "hf", max_shard_bytes=20_000)  # the root: latest
    files = sorted(os.listdir(written))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 3 and "model.safetensors.index.json" in files and directory.endswith("step-0000000007")
    index = json.load(open(os.path.join(written, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def test_safetensors_and_torch_hold_every_name_tied_ones_too(tmp_path):
    from safetensors.torch import load_file

    model = _gpt2(seed=2)
    directory = _save(model, tmp_path / "ckpt")
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith(".attn.bias")}  # buffers aside
    (st,) = export(directory, str(tmp_path / "w.safetensors"), "safetensors")
    (pt,) = export(directory, str(tmp_path / "w.pt"), "torch")
    for got in (load_file(st), torch.load(pt, weights_only=True), load_state_dict(directory)):
        params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
        assert set(got) == params and "lm_head.weight" in got
        for name in got:
            assert torch.equal(got[name], expected[name]), name


def test_bad_exports_say_what_is_wrong_and_leave_nothing_behind(tmp_path):
    model = _gpt2()
    directory = _save(model, tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="taken: exists already"):
        export(directory, str(tmp_path / "taken"), "hf")
    with pytest.raises(ValueError, match="does not exist"):
        export(directory, str(tmp_path / "no" / "such" / "w.safetensors"), "safetensors")
    with pytest.raises(ValueError, match="no such checkpoint"):
        export(str(tmp_path / "nothing"), str(tmp_path / "w.safetensors"), "safetensors")
    with pytest.raises(ValueError, match="over the 0.0 GiB"):
        load_state_dict(directory, limit_bytes=1000)
    plain = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    with pytest.raises(ValueError, match="not a Hugging Face model"):
        export(_save(plain, tmp_path / "plain"), str(tmp_path / "plain-hf"), "hf")
    # an unwritable directory: one error, and no temporary file left
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere")
        with pytest.raises(OSError):
            export(directory, str(locked / "w.safetensors"), "safetensors")
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o700)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "locked", "plain", "taken"]


def test_a_failure_in_the_middle_of_an_export_removes_the_partial_output(tmp_path, monkeypatch):
    from elastic_zero.checkpoint import export as module

    directory = _save(_gpt2(), tmp_path / "ckpt")
    real = module.iter_weights

    def broken(fs, d, scratch=False):
        for i, item in enumerate(real(fs, d, scratch)):
            if i == 5:
                raise OSError("disk full (injected)")
            yield item

    monkeypatch.setattr(module, "iter_weights", broken)
    for fmt, out in (("safetensors", "w.safetensors"), ("hf", "hf")):
        with pytest.raises(OSError, match="injected"):
            export(directory, str(tmp_path / out), fmt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_buffers_and_frozen_parameters_saved_with_the_final_weights_are_exported(tmp_path):
    """The engine trains parameters only; the final save adds the rest of the state dict (buffers,
    frozen parameters) in a file of its own, and every export holds it."""
    import pyarrow.fs as pafs
    from safetensors.torch import load_file

    from elastic_zero.checkpoint import safetensors_format
    from elastic_zero.checkpoint.export import MODEL_TENSORS_FILE, MODEL_TENSORS_KEY

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)]))
    model[0][2].weight.requires_grad_(False)  # frozen
    model[0][1].running_mean.add_(3.0)  # a buffer with a value of its own
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    layout = build_layout([s for s, _ in param_specs(model, find_units(model))])
    shards = shards_from_state_dict(trainable, layout, 2, ["params"], step=3)
    directory = save(str(tmp_path / "ckpt"), shards, stage=2,
                     extra={**model_extra(model), MODEL_TENSORS_KEY: MODEL_TENSORS_FILE})
    rest = {k: v for k, v in model.state_dict().items() if k not in trainable}
    safetensors_format.write_all(pafs.LocalFileSystem(), f"{directory}/{MODEL_TENSORS_FILE}", rest)
    (st,) = export(directory, str(tmp_path / "w.safetensors"), "safetensors")
    for got in (load_file(st), load_state_dict(directory)):
        assert set(got) == set(model.state_dict())
        for name, value in model.state_dict().items():
            assert torch.equal(got[name], value), name
    assert load_file(st)["0.1.num_batches_tracked"].dtype == torch.int64


def test_a_checkpoint_directory_keeps_its_stores_uri():
    from elastic_zero.checkpoint.catalog import directory_uri, step_of_directory

    s3 = "s3://bucket/run?endpoint_override=http://127.0.0.1:9000&scheme=http"
    assert directory_uri(s3, "bucket/run/step-0000000040") == \
        "s3://bucket/run/step-0000000040?endpoint_override=http://127.0.0.1:9000&scheme=http"
    assert directory_uri("hdfs://nn:8020/x/run/", "/x/run/step-0000000040-1") == "hdfs://nn:8020/x/run/step-0000000040-1"
    assert directory_uri("/tmp/run", "/tmp/run/step-0000000040") == "/tmp/run/step-0000000040"
    assert step_of_directory("/tmp/run/step-0000000040-2") == 40 and step_of_directory("/tmp/run/latest") is None


def test_exported_weights_start_a_model_again_read_a_tensor_at_a_time(tmp_path):
    """init_from takes a safetensors file and a Hugging Face directory (the exports above): a real
    model loads them, a meta model's engine takes them unit by unit; a truncated file is named."""
    from elastic_zero.checkpoint import load_initial_weights, load_into
    from elastic_zero.checkpoint.safetensors_format import LazyTensors
    from elastic_zero.zero import AdamW, ZeroEngine
    from elastic_zero.zero.meta import meta_init

    model = _gpt2(seed=4)
    directory = _save(model, tmp_path / "ckpt")
    (st,) = export(directory, str(tmp_path / "w.safetensors"), "safetensors")
    (hf,) = export(directory, str(tmp_path / "hf"), "hf", max_shard_bytes=30_000)  # sharded, with an index
    expected = dict(model.named_parameters())
    for source in (st, hf):
        weights = load_initial_weights(source)
        assert isinstance(weights, LazyTensors) and set(expected) <= set(weights)
        real = _gpt2(seed=9)
        load_into(real, weights)
        with meta_init():
            meta = _gpt2()
        engine = ZeroEngine(meta, AdamW(), stage=3, init_values=weights)
        for name, value in engine.full_state_dict().items():
            if name in expected:
                assert torch.equal(value, expected[name]) and torch.equal(dict(real.named_parameters())[name], value), name
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(open(st, "rb").read()[:-1000])
    with pytest.raises(ValueError, match=r"cut.safetensors: truncated at tensor"):
        load_into(_gpt2(), load_initial_weights(str(cut)))


def _start_from_each(ctx, cases):
    """For each (sources, stage): a meta GPT-2's engine on this rank, started from sources[rank];
    its weights and the bytes this rank read of them, or the error it raised."""
    from elastic_zero.checkpoint import load_initial_weights
    from elastic_zero.zero import AdamW, ZeroEngine
    from elastic_zero.zero.meta import meta_init

    out = []
    for sources, stage in cases:
        weights = load_initial_weights(sources[ctx.rank])
        with meta_init():
            meta = _gpt2()
        try:
            engine = ZeroEngine(meta, AdamW(), stage=stage, process_group=ctx.process_group, init_values=weights)
        except ValueError as exc:
            out.append(str(exc))
            continue
        out.append((engine.full_state_dict(), weights.bytes_read))
    return out


def test_a_zero3_rank_reads_only_its_share_of_the_weights_it_starts_from(tmp_path):
    """At stage 3 each rank reads the ranges of its own shard from a safetensors file, a sharded
    Hugging Face directory or one of our checkpoints: two ranks read the model about once between
    them (at stage 1, where every rank holds whole units, each reads all of it). Oracle: the model the
    files came from. Ranks given different checkpoints refuse to start."""
    from elastic_zero.testing.local_group import run_local_group
    from elastic_zero.checkpoint import load_into
    from elastic_zero.checkpoint.checkpoint_tensors import CheckpointTensors

    model = _gpt2(seed=4)
    expected = dict(model.named_parameters())
    model_bytes = sum(p.numel() * 4 for p in expected.values())
    directory = _save(model, tmp_path / "ckpt", block_numel=100)
    (st,) = export(directory, str(tmp_path / "w.safetensors"), "safetensors")
    (hf,) = export(directory, str(tmp_path / "hf"), "hf", max_shard_bytes=30_000)
    other = _save(_gpt2(seed=5), tmp_path / "other")
    sources = (st, hf, directory)
    cases = [([s, s], 3) for s in sources] + [([st, st], 1), ([directory, other], 3)]
    rank0, rank1 = run_local_group(_start_from_each, 2, args=(cases,), timeout_s=180)
    for source, (state0, read0), (state1, read1) in zip(sources, rank0, rank1):
        assert state0.keys() == state1.keys()
        for name, value in expected.items():
            assert torch.equal(state0[name], value) and torch.equal(state1[name], value), (source, name)
        # each rank its half, and a part of a block at its edges where the source is a checkpoint
        assert 0.4 * model_bytes < read0 < 0.6 * model_bytes and 0.4 * model_bytes < read1 < 0.6 * model_bytes, \
            (source, read0, read1, model_bytes)
    assert rank0[3][1] >= model_bytes and rank1[3][1] >= model_bytes  # stage 1
    assert "built different weights to start from" in rank0[4] and "built different" in rank1[4]
    # a real model takes a checkpoint's tensors one by one
    real = _gpt2(seed=9)
    load_into(real, CheckpointTensors(*pafs.FileSystem.from_uri(os.path.abspath(directory))))
    assert all(torch.equal(p, expected[n]) for n, p in real.named_parameters())


def test_a_local_torch_save_file_to_start_from_is_mapped_not_read_whole(tmp_path):
    """init_from's torch.save'd file, local: its tensors are read as they are touched (a joiner's
    skeleton touches none), where reading it whole held the file and its tensors at once. A file of
    torch's legacy format, which cannot be mapped, is read whole. Oracle: torch.load's values."""
    import os

    from elastic_zero.checkpoint import load_initial_weights
    from elastic_zero.node_memory import rss_bytes

    big = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MiB
    torch.save({"w": big}, tmp_path / "w.pt")
    torch.save({"w": big[:10]}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    before = rss_bytes(os.getpid())
    weights = load_initial_weights(str(tmp_path / "w.pt"))
    assert rss_bytes(os.getpid()) - before < 16 * 2**20  # nothing of the 64 MiB read yet
    assert torch.equal(weights["w"], big)
    assert torch.equal(load_initial_weights(str(tmp_path / "legacy.pt"))["w"], big[:10])
