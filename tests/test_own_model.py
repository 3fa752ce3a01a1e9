"""Jobs with the user's own model, loss and data on a real local Ray: a Hugging Face Llama from TOML
and from Python with a kill and a scale-up; ragged token data with the token-weighted default loss
against torch's AdamW on one process; epochs; init_from; bad user code ending the job in one line."""

import importlib.util
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import elastic_zero as ez
from elastic_zero.data.collate import token_collate
from elastic_zero.data.source import open_source
from elastic_zero.losses import next_token_loss
from elastic_zero.models import build_preset
from elastic_zero.checkpoint.catalog import list_checkpoints, open_store
from elastic_zero.plan.batches import rank_positions
from elastic_zero.job.build import build_model
from elastic_zero.job.spec import DataSpec, load_spec
from elastic_zero.job.user_code import UserCodeError
from runtime_jobs import exactly_once, relative

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"vocab_size": 32, "seq_len": 16, "n_layer": 1, "d_model": 32}


def _hf_example():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_llama_train", os.path.join(ROOT, "examples/hf_llama/train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_elastic(summary):
    exactly_once(summary)
    sizes = [n for _, n in summary["world_size_history"]]
    assert len(summary["recoveries"]) == 1 and 1 in sizes and sizes[-1] == 3, summary["world_size_history"]
    assert 0 < summary["final_metrics"]["accuracy"] <= 1


@pytest.mark.long  # 2.3 minutes of CI's two cores; a Hugging Face model through a kill and joiners: test_large_model_path.py
def test_a_hugging_face_llama_survives_a_kill_and_a_scale_up_from_toml_and_python(tmp_path, local_ray):
    """The oracle is the TOML's job without its faults, run by the CLI; the same job from Python,
    with the kill and the scale-up, must end with the same weights."""
    example = _hf_example()
    # on the suite's Ray (the CLI's own run of a TOML is tested in test_cli.py): the factory and the
    # loss are imported by name, from the repository root
    clean = ez.run(load_spec(os.path.join(ROOT, "examples/hf_llama/job.toml"), ["faults=[]"]),
                   ez.RunConfig(run_dir=str(tmp_path / "toml")))
    assert clean.ok, clean.error
    assert clean.metrics["world_size_history"] == [[0, 2]] and 0 < clean.metrics["final_metrics"]["accuracy"] <= 1

    elastic = ez.run(example.job(name="llama-py"), ez.RunConfig(run_dir=str(tmp_path / "py")))
    assert elastic.ok, elastic.error
    _check_elastic(elastic.metrics)
    assert relative(clean.state_dict, elastic.state_dict) < 1e-4


def _ragged_dataset(path, rows=40):
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 20, (rows,), generator=g).tolist()
    tokens = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    pq.write_table(pa.table({"tokens": tokens}), path, row_group_size=7)


def _ragged_job(source, name, workers, micro_batch, **train):
    return ez.Job(name=name, model={"preset": "gpt-tiny", "kwargs": TINY}, data=str(source),
                  train={"steps": 3, "global_batch": 9, "micro_batch": micro_batch, "grad_clip": None, **train},
                  optimizer={"lr": 1e-2}, zero={"stage": 2},
                  elastic={"workers": workers, "min_workers": 1, "max_workers": workers})


def test_ragged_samples_train_exactly_like_torch_adamw_on_the_global_token_mean(tmp_path, local_ray):
    """Samples of 1 to 18 targets, padded per micro batch: the loss is the mean over the global batch's
    target tokens, so 2 workers (shares of 5 and 4) with micro batches of 2 train like one process with
    torch's AdamW."""
    source = tmp_path / "ragged.parquet"
    _ragged_dataset(source)
    result = ez.run(_ragged_job(source, "ragged", workers=2, micro_batch=2), ez.RunConfig(run_dir=str(tmp_path / "r")))
    assert result.ok, result.error
    exactly_once(result.metrics)

    model = build_preset("gpt-tiny", seed=0, **TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = open_source(DataSpec(source=str(source)), seed=0, vocab_size=None, seq_len=TINY["seq_len"], collate=None)
    for step in range(3):
        optimizer.zero_grad()
        batch = data.batch(rank_positions(step, 9, 1, 0))
        loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
    assert result.metrics["final_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert relative(model.state_dict(), result.state_dict) < 1e-5


def test_epochs_init_from_and_a_users_collate(tmp_path, local_ray):
    source = tmp_path / "ragged.parquet"
    _ragged_dataset(source, rows=30)
    job = _ragged_job(source, "epochs", workers=2, micro_batch=3, steps=None, epochs=2)
    job = ez.Job(**{**vars(job), "checkpoint": ez.CheckpointConfig(uri=str(tmp_path / "ck"), every=4)})
    first = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "e")))
    assert first.ok and first.metrics["steps"] == 2 * 30 // 9  # whole global batches only
    assert first.checkpoint.endswith("step-0000000006")  # the last step's

    def fixed_width(table):  # a user's collate: every sample cut/padded to 8 tokens, sample mean
        b = token_collate(table, "tokens", 8, fixed_length=True)
        return {"input_ids": b["input_ids"], "targets": b["targets"]}

    job = _ragged_job(source, "init", workers=1, micro_batch=3)  # another size than the checkpoint's
    # init_from: one of our checkpoints (its root: the latest commit); a plain state dict is tested in test_spec
    job = ez.Job(**{**vars(job), "model": {"preset": "gpt-tiny", "kwargs": TINY, "init_from": str(tmp_path / "ck")},
                    "optimizer": {"lr": 0.0}, "data": {"source": str(source), "collate": fixed_width}})
    again = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "i")))
    assert again.ok, again.error
    assert relative(first.state_dict, again.state_dict) == 0  # lr 0: the weights it started from


def _bad(loss=None, data=None, steps=3, model=None, checkpoint=None, replicate_every="auto"):
    def runs(tmp_path, name):
        job = ez.Job(name=name, model=model or {"preset": "gpt-tiny", "kwargs": TINY}, data=data or "synthetic",
                     train={"steps": steps, "global_batch": 4, "loss": loss}, checkpoint=checkpoint or {},
                     # one worker: the checks are each worker's own
                     elastic={"workers": 1, "max_workers": 1, "replicate_every": replicate_every})
        return ez.run(job, ez.RunConfig(run_dir=str(tmp_path / name)))
    return runs


def _weightless(table):
    return {**token_collate(table, "tokens", None), "sample_weight": torch.zeros(table.num_rows)}


def _not_a_module():
    return {"weight": torch.zeros(3)}


def _loss_wants_labels(model, batch):
    return model(batch["labels"])


def _nan_loss_from_step_2(model, batch):
    model.calls = getattr(model, "calls", 0) + model.training  # one training call a step: one worker, one micro batch
    return next_token_loss(model, batch) * (float("nan") if model.calls > 2 and model.training else 1.0)


def test_a_nan_loss_read_late_fails_the_job_before_an_evaluation_of_its_weights(tmp_path, local_ray):
    """A step's loss is read back a step late (worker/closing_summary.py), but before an evaluation
    due after it: the job fails naming the train loss at its step, not the evaluation of nan weights.
    (Before a save, too: test_bad_user_code_and_data_end_the_job_in_one_line.)"""
    # without replicas nothing else reads step 2's loss before the evaluation after it: the default
    # cadence commits, and so reads, each of a generation's first steps
    uri = f"file://{tmp_path}/ckpt"
    job = ez.Job(name="nan-eval", model={"preset": "gpt-tiny", "kwargs": TINY}, data="synthetic",
                 train={"steps": 6, "global_batch": 4, "loss": _nan_loss_from_step_2}, checkpoint={"uri": uri},
                 eval={"source": "synthetic", "batches": 1, "every": 3},
                 elastic={"workers": 1, "max_workers": 1, "replicate_every": 0})
    result = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "run")))
    assert not result.ok and "train.loss: the loss is nan at step 2" in result.error, result.error
    assert list_checkpoints(*open_store(uri)) == []


def _fp16_overflow_at_step_2(model, batch):
    model.calls = getattr(model, "calls", 0) + model.training  # one training call a step: a micro batch a worker
    return next_token_loss(model, batch) * (1e30 if model.calls == 3 and model.training else 1.0)


def test_an_fp16_step_skipped_after_a_commit_is_not_committed_again(tmp_path, local_ray):
    """Step 2 overflows (the loss scaler skips it: the count stays at the commit of step 2's count):
    no commit follows it, so no rank holds more replicas than the memory plan counts. Red when the
    skipped step committed again (each rank then warns, worker/commits.py)."""
    job = ez.Job(name="fp16", model={"preset": "gpt-tiny", "kwargs": TINY}, data="synthetic",
                 train={"steps": 6, "global_batch": 8, "loss": _fp16_overflow_at_step_2},
                 zero={"compute_dtype": "float16"}, elastic={"workers": 2, "max_workers": 2, "replicate_every": 2})
    result = ez.run(job, ez.RunConfig(run_dir=str(tmp_path / "run")))
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert result.ok and result.metrics["steps"] == 6, result.error
    assert not [e["message"] for e in events if e["event"] == "warning"]


def test_bad_user_code_and_data_end_the_job_in_one_line(tmp_path, local_ray):
    # (a loss of the wrong shape ends the job the way a raising one does, below: the same statement raises
    # both; its message is test_batches_and_losses.py's test_the_loss_contract_is_checked)
    # a factory that returns no module: the worker's build raises it (its way to one line through a job:
    # test_runtime_hardening's worker that cannot start)
    with pytest.raises(UserCodeError, match="^model.factory: must return a torch.nn.Module, got dict$"):
        build_model(ez.Job(name="not-a-module", model=_not_a_module, train={"steps": 3, "global_batch": 4}))

    result = _bad(loss=_loss_wants_labels)(tmp_path, "raising-loss")
    assert not result.ok and "train.loss: raised KeyError: 'labels'" in result.error

    # the loss is read back a step late (worker/closing_summary.py), but before the final weights' save
    # (without replicas: a commit's copy would read it first)
    uri = f"file://{tmp_path}/nan-ckpt"
    result = _bad(loss=_nan_loss_from_step_2, checkpoint={"uri": uri}, replicate_every=0)(tmp_path, "nan-loss")
    assert not result.ok and "train.loss: the loss is nan at step 2" in result.error
    assert list_checkpoints(*open_store(uri)) == []  # (the same job with a finite loss writes step 3's)

    # a collate's sample weights are summed over ranks on the device and checked with the step's summary
    # (the other check, weights in some micro batches only: test_closing_summary.py)
    pq.write_table(pa.table({"tokens": [[1, 2, 3, 4]] * 16}), tmp_path / "plain.parquet")
    result = _bad(data={"source": str(tmp_path / "plain.parquet"), "collate": _weightless})(tmp_path, "weightless")
    assert not result.ok and "data: the global batch of step 0 carries no loss terms" in result.error, result.error

    rows = [[1, 2, 3]] * 7 + [[1, 40, 2]]  # token 40 is outside the vocabulary of 32
    pq.write_table(pa.table({"tokens": rows}), tmp_path / "vocab.parquet")
    result = _bad(data=str(tmp_path / "vocab.parquet"))(tmp_path, "vocab")
    assert not result.ok and "vocab.parquet row 7: token id 40 in 'input_ids' is outside the model's vocabulary of 32" in result.error


def test_the_byte_gpt_example_makes_its_corpus_and_its_spec_reads_it(tmp_path):
    """The byte_gpt example's script makes the corpus its TOML trains on (the training itself, on the
    same corpus and model shape, is the demo's: tests/test_demo.py)."""
    from elastic_zero.data.arrow_rows import ArrowRows
    from elastic_zero.job.spec import load_spec

    data = tmp_path / "bytes"
    made = subprocess.run([sys.executable, "examples/byte_gpt/make_dataset.py", "--out", str(data), "--max-mb", "0.2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    spec = load_spec(os.path.join(ROOT, "examples/byte_gpt/job.toml"), [f"data.source={json.dumps(str(data))}"])
    rows = ArrowRows(spec.data.source, [spec.data.column])
    assert rows.num_samples == int(made.stdout.split()[0]) > 1000
    assert spec.model.kwargs["vocab_size"] == 256 and spec.model.kwargs["seq_len"] == 128
