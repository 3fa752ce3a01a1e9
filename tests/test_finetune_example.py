"""examples/finetune_hf end to end, as a user runs it (its --short version): a Llama directory made with
save_pretrained, pre-trained, then fine-tuned in full and with LoRA through init_from, with evaluation,
MLflow, a kill and a preemption notice; the exports loaded with from_pretrained. Oracles: the job's
own final evaluation (the exported directory must give the same eval loss through transformers), the
pre-trained model's loss (fine-tuning must lower it), and the run's events (the faults happened)."""

import fnmatch
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "finetune_hf", "finetune.py")


@pytest.mark.unit
def test_merged_lora_weights_give_the_adapted_models_logits(tmp_path):
    """Oracle: the LoRA model itself, with trained (non-zero) adapters, against plain Llama weights
    merged from its state dict; and before training, the pre-trained model (B = 0)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, ROOT)
    from examples.finetune_hf.model import LORA_PARAMS, llama_config, merge_lora, with_lora

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(hidden_size=32, layers=2, seq_len=16)).save_pretrained(tmp_path / "base")
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    lora = with_lora(str(tmp_path / "base"), rank=4, alpha=8.0)
    lora.load_state_dict(plain.state_dict(), strict=False)  # as init_from does, the adapters left as built
    lora.eval()
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trained and all(fnmatch.fnmatchcase(n, LORA_PARAMS[0]) or fnmatch.fnmatchcase(n, LORA_PARAMS[1])
                           for n in trained)
    ids = torch.randint(0, 256, (2, 16))
    assert torch.allclose(lora(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6)  # B = 0
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)
    merged = LlamaForCausalLM(plain.config)
    merged.load_state_dict(merge_lora(lora.state_dict(), rank=4, alpha=8.0), strict=True)
    assert torch.allclose(merged.eval()(input_ids=ids).logits, lora(input_ids=ids).logits, atol=1e-5)
    assert not torch.allclose(merged(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-3)
    with pytest.raises(ValueError, match="rank 4, but merge_lora was given rank 8"):
        merge_lora(lora.state_dict(), rank=8, alpha=8.0)


@pytest.mark.runtime
@pytest.mark.long  # 2.5 minutes of CI's two cores; its parts: LoRA's merge above, init_from, eval and MLflow in theirs
def test_the_fine_tune_example_runs_end_to_end_through_a_kill_and_a_notice(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("mlflow")
    out = tmp_path / "ft"
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--short"], capture_output=True, text=True,
                          timeout=400, cwd=tmp_path)  # not the repository root: the script finds its own
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.load(open(out / "report.json"))

    full, lora = report["finetuned-full"], report["finetuned-lora"]
    for stage, summary in (("full", full), ("lora", lora)):
        losses = [loss for _, loss in summary["eval_curve"]]
        assert summary["eval_curve"][0][0] == 0 and losses[-1] < losses[0] - 0.01, summary["eval_curve"]
        assert summary["duplicate_samples"] == 0 and summary["skipped_samples"] == 0
        # the kill's recovery, as in test_demo.py: a loaded machine may add one, which loses no step
        recoveries = summary["recoveries"]
        why = recoveries, [e for e in map(json.loads, open(out / stage / "events.jsonl"))
                           if e["event"] in ("worker_lost", "generation_end") or e.get("on") == "Silence"]
        assert [r["cause"] for r in recoveries if r["step"] == 4] == ["lost w1"], why
        assert all(r["lost_steps"] == 0 for r in recoveries), why
    assert any(c["cause"] == "leave" for c in full["reconfigurations"]), full["reconfigurations"]  # the notice

    checked = report["check"]
    pretrained = checked["pretrained"]["eval_loss"]
    assert pretrained == pytest.approx(full["eval_curve"][0][1], abs=1e-4)  # the job's step-0 evaluation
    for name in ("finetuned-full", "finetuned-lora"):
        assert checked[name]["eval_loss"] == pytest.approx(checked[name]["job_final_eval_loss"], abs=1e-4), name
        assert checked[name]["eval_loss"] < pretrained - 0.01, name
        assert checked[name]["generated"].startswith("The with statement ") and len(checked[name]["generated"]) > 30
    assert not any(k.endswith(("lora_A", "lora_B")) for k in _weight_names(out / "finetuned-lora"))

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's own client, as the coordinator does
    client = MlflowClient(tracking_uri=str(out / "mlruns"))
    experiment = client.get_experiment_by_name("finetune-hf")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"finetune-hf", "finetune-hf-lora"}, set(runs)
    for name, summary in (("finetune-hf", full), ("finetune-hf-lora", lora)):
        run = runs[name]
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "eval/loss")
        assert [(m.step, round(m.value, 6)) for m in history] == [(s, round(v, 6)) for s, v in summary["eval_curve"]]
        assert run.data.params["model.init_from"] == str(out / "pretrained")
    assert os.path.exists(out / "full" / "run.png")


def _weight_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.unit
def test_a_lora_model_built_on_the_meta_device_starts_as_the_pretrained_one(tmp_path):
    """`model.new_params` on a meta model: the worker's initial model (init_from the pretrained
    directory, the adapters named new) and its engine at stage 3. The pretrained weights come from
    the directory, the adapters from LoRALinear.reset_parameters() unit by unit: B = 0, so the model's
    logits are the pretrained model's (the oracle), and A within nn.Linear's own bound."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaForCausalLM

    from elastic_zero.job.spec import spec_from_dict
    from elastic_zero.worker.initial_model import initial_model
    from elastic_zero.worker.worker_model import WorkerModel
    from elastic_zero.zero import AdamW

    sys.path.insert(0, ROOT)
    from examples.finetune_hf.model import LORA_PARAMS, llama_config

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(hidden_size=32, layers=2, seq_len=16)).save_pretrained(tmp_path / "base")
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    spec = spec_from_dict({"model": {"factory": "examples.finetune_hf.model:with_lora", "wrap": ["LlamaDecoderLayer"],
                                     "kwargs": {"path": str(tmp_path / "base"), "rank": 4, "on_meta": True},
                                     "init_from": str(tmp_path / "base"), "new_params": LORA_PARAMS},
                           "zero": {"stage": 3}})
    built = initial_model(spec, torch.device("cpu"))
    adapters = {n for n, _ in built.model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    assert adapters and built.own_init == adapters
    engine = WorkerModel(spec, torch.device("cpu"), AdamW(), built).new_engine(None)
    state = engine.full_state_dict()
    assert all(torch.equal(state[n], v) for n, v in plain.state_dict().items() if n in state)
    assert all(torch.equal(state[n], torch.zeros_like(state[n])) for n in adapters if n.endswith("lora_B"))
    a = state["model.layers.0.self_attn.q_proj.lora_A"]
    assert 0 < a.abs().max() <= 1 / 32 ** 0.5 and a.std() > 0.05  # kaiming_uniform(a=sqrt(5)) over 32 inputs
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(engine.module.eval()(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)
