"""A model built on the meta device, through the whole runtime on a real local Ray: its workers give
it values unit by unit (from init_from), a kill and a scale-up bring joiners whose engines stay hollow
until the handover fills them, and the final weights are a checkpoint the workers write, exported as a
Hugging Face directory. Oracle: the model built for real from the same weights, trained by torch's AdamW
on one process over the job's batches (torch_oracle.py)."""

import pytest
import torch

import elastic_zero as ez
from runtime_jobs import exactly_once, relative
from torch_oracle import AdamWTrajectory

pytestmark = [pytest.mark.runtime, pytest.mark.usefixtures("local_ray")]
transformers = pytest.importorskip("transformers")

STEPS = 160


def _config():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tiny_gpt2(on_meta: bool = False):
    if on_meta:
        with ez.meta_init():
            return transformers.GPT2LMHeadModel(_config())
    return transformers.GPT2LMHeadModel(_config())


def gpt2_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))


def slow_gpt2_loss(model, batch):
    """The same loss, with every micro batch of 4 samples taking 80 ms more: below 3 workers (a rank's
    share of the global batch of 8 is then 4 or 8) the drill's steps last at least 80 ms, so that the
    joiners (torch and transformers to import, on a loaded machine) come before its last; once the
    scale-up to 3 has them all (shares of 3 and 2), the rest runs unpaced. (Its steps at 3 are what
    the drill costs CPU: 300 steps at 40 ms took 34-66 s of CI's test time.)"""
    import time

    if len(batch["input_ids"]) == 4:
        time.sleep(0.08)
    return gpt2_loss(model, batch)


def _job(name, on_meta, init_from, faults=()):
    return ez.Job(name=name, model={"factory": tiny_gpt2, "kwargs": {"on_meta": on_meta}, "wrap": ["GPT2Block"],
                                    "init_from": init_from},
                  data={"source": "synthetic", "seq_len": 16, "vocab_size": 64},
                  train={"steps": STEPS, "global_batch": 8, "micro_batch": 4,
                         "loss": slow_gpt2_loss if faults else gpt2_loss},
                  zero={"stage": 3}, faults=list(faults),
                  # joiners join as soon as each is ready: the tiny job's steps take milliseconds
                  elastic={"workers": 2, "min_workers": 1, "max_workers": 3, "join_window_s": 0})


def test_a_meta_model_trains_through_kills_and_joiners_and_exports_for_hugging_face(tmp_path):
    torch.manual_seed(3)
    torch.save(transformers.GPT2LMHeadModel(_config()).state_dict(), tmp_path / "start.pt")
    start = str(tmp_path / "start.pt")

    def built_for_real():
        model = tiny_gpt2()
        model.load_state_dict(torch.load(start, weights_only=True))
        return model

    oracle = AdamWTrajectory(_job("real", False, start), built_for_real).weights_at(STEPS)
    drill = [{"at_step": 8, "action": "kill", "rank": 1}, {"at_step": 12, "action": "scale", "workers": 3}]
    meta = ez.run(_job("meta", True, start, drill), ez.RunConfig(run_dir=str(tmp_path / "meta"), progress=False))
    assert meta.ok, meta.error
    sizes = [n for _, n in meta.metrics["world_size_history"]]
    assert len(meta.metrics["recoveries"]) == 1 and sizes[:2] == [2, 1] and max(sizes[2:]) >= 2, sizes  # joiners came
    exactly_once(meta.metrics)
    assert meta.final_checkpoint.startswith(str(tmp_path / "meta" / "checkpoints"))
    assert relative(oracle, meta.state_dict) < 1e-4

    from elastic_zero.checkpoint.export import export

    (hf,) = export(meta.final_checkpoint, str(tmp_path / "hf"), "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    direct = transformers.GPT2LMHeadModel(_config()).eval()
    direct.load_state_dict(meta.state_dict, strict=False)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, direct(tokens).logits)
