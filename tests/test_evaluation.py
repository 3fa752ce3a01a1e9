"""An evaluation's result is the exact weighted mean over the whole eval set, whatever the world size
and the ZeRO stage (worker/evaluation.py on local gloo ranks), and it leaves the engine as it was (no step taken, the model back in training mode).
Oracle: the same model's loss over every sample of the set on one process, with no engine."""

import pytest
import torch

from elastic_zero.testing.local_group import run_local_group
from elastic_zero.job.spec import spec_from_dict

SPEC = {"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 8, "micro_batch": 3, "steps": 10},
        "eval": {"source": "synthetic", "batches": 3, "every": 5}}  # 24 samples: uneven shares at 5 ranks


def _oracle() -> float:
    from elastic_zero.job.build import build_model, build_source
    from elastic_zero.losses import next_token_loss

    spec = spec_from_dict(SPEC)
    model = build_model(spec)
    source = build_source(spec, model, evaluation=True)
    with torch.no_grad():  # one sample at a time: no micro batch split shared with the code under test
        losses = [next_token_loss(model, source.batch(range(i, i + 1))) for i in range(24)]
    tokens = [source.batch(range(i, i + 1))["targets"].numel() for i in range(24)]
    return float(sum(l.double() * t for l, t in zip(losses, tokens)) / sum(tokens))


def _evaluate(ctx, stage: int):
    from elastic_zero.job.build import build_model
    from elastic_zero.worker.evaluation import Evaluator
    from elastic_zero.zero import AdamW, TorchComm, ZeroEngine

    spec = spec_from_dict(SPEC)
    model = build_model(spec)
    engine = ZeroEngine(model, AdamW(lr=1e-3), stage=stage, process_group=ctx.process_group)
    evaluator = Evaluator(spec, model)
    result = evaluator.evaluate(engine.module, TorchComm(ctx.process_group), ctx.world_size, ctx.rank, 5,
                                torch.device("cpu"), lambda fn, batch: fn(engine.module, batch))
    return (result.loss, result.samples, result.step, result.perplexity), engine.step_count, engine.module.training


@pytest.mark.runtime
@pytest.mark.parametrize("stage", [1, 3])
def test_the_eval_loss_is_the_weighted_mean_over_the_whole_set_at_every_world_size(stage):
    expected = _oracle()
    for world in (1, 2, 5):
        for (loss, samples, step, perplexity), steps, training in run_local_group(_evaluate, world, args=(stage,),
                                                                                  timeout_s=240):
            assert abs(loss - expected) <= 1e-6 * expected, (world, loss, expected)
            assert samples == 24 and step == 5 and steps == 0 and training
            assert perplexity == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-6)


@pytest.mark.runtime
@pytest.mark.usefixtures("local_ray")
def test_a_job_evaluates_as_asked_and_an_evaluation_cut_by_a_kill_is_done_again_once(tmp_path):
    """Rank 1 dies as the evaluation after step 20 begins (its peer is then inside it, stage 3): the
    recovery goes on from the replicas at step 20 and evaluates it again. Every evaluation is in the
    summary once, the events tell each once, and the last is the oracle's loss of the final weights."""
    from runtime_jobs import job

    from elastic_zero.job.build import build_model, build_source
    from elastic_zero.losses import next_token_loss

    code, summary, events, weights = job(
        tmp_path, "eval", [{"at_step": 20, "action": "kill_in_eval", "rank": 1}],
        train={"steps": 30, "global_batch": 8, "micro_batch": 4}, zero={"stage": 3},
        eval={"source": "synthetic", "batches": 2, "every": 10})
    assert code == 0, summary.get("error")
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    (recovery,) = summary["recoveries"]
    assert recovery["step"] == 20 and recovery["lost_steps"] == 0
    assert [e["step"] for e in summary["evals"]] == [0, 10, 20, 30]
    assert [s for s, _ in summary["eval_curve"]] == [0, 10, 20, 30]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 10, 20, 30]  # none half, none twice
    told_20 = next(e for e in events if e["event"] == "eval" and e["step"] == 20)
    assert told_20["t"] > lost["t"] and told_20["generation"] > 0  # by the generation after the recovery
    curve = dict(summary["eval_curve"])
    assert curve[30] < curve[0]  # it learned
    from elastic_zero.plot import plot_run

    _, series = plot_run(str(tmp_path / "eval"))  # the eval loss is the loss panel's second line
    assert list(series.eval_loss) == [tuple(p) for p in summary["eval_curve"]]
    assert summary["final_eval"]["samples"] == 16 and summary["final_eval"]["perplexity"] > 1
    # the oracle: the final weights' loss over the 16 samples on one process
    spec = spec_from_dict({"model": {"preset": "gpt-tiny"}, "train": {"global_batch": 8},
                           "eval": {"source": "synthetic", "batches": 2}})
    model = build_model(spec)
    model.load_state_dict(weights)
    source = build_source(spec, model, evaluation=True)
    with torch.no_grad():
        expected = float(next_token_loss(model, source.batch(range(16))))  # equal lengths: the token mean
    assert abs(curve[30] - expected) <= 1e-5 * expected, (curve[30], expected)
