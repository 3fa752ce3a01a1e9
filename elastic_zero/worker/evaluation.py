"""A worker's part of an evaluation ([eval], plan/evaluation.py): forward only over its share of
the eval set, with no gradient and no optimizer state touched, at the stage's memory (a stage-3
unit is gathered for its forward and freed after it, as in training). One all-reduce then gives
every rank the weighted mean over the whole set."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from elastic_zero.data.source import READ_AHEAD_SAMPLES
from elastic_zero.job.build import build_eval_loss, build_source
from elastic_zero.losses import batch_weight, checked, next_token_loss, read_step_summary, step_summary
from elastic_zero.plan.evaluation import eval_micro_batches, eval_size


@dataclass(frozen=True)
class EvalResult:
    step: int  # the optimizer steps the evaluated weights had taken
    loss: float  # the weighted mean over the eval set
    metrics: dict  # the eval loss's other metrics, weighted the same way
    samples: int  # the eval set's size
    perplexity: float | None = None  # exp(loss), where the loss is the default token cross-entropy
    seconds: float | None = None  # how long this rank's evaluation took, its all-reduce included


class Evaluator:
    def __init__(self, spec, model) -> None:
        self.spec = spec
        self.source = build_source(spec, model, evaluation=True)
        self.loss_fn = build_eval_loss(spec)
        self.token_loss = self.loss_fn is next_token_loss
        self.size = eval_size(spec.eval.batches, spec.train.global_batch, self.source.num_samples)
        if self.size < 1:
            raise ValueError(f"eval.source: {spec.eval.source} holds no samples")

    def evaluate(self, module: torch.nn.Module, comm, world: int, rank: int, step: int, device,
                 call_loss, finite: bool = True) -> EvalResult:
        """This rank's share, then the sums over all ranks. `call_loss(fn, batch)` runs the loss as
        training does (a lost peer inside a stage-3 forward is a fault, not the loss's bug); `finite`:
        a non-finite loss is an error, as in training (not at float16, where overflows happen)."""
        began = time.monotonic()
        pieces = eval_micro_batches(self.size, world, rank, self.spec.train.micro_batch)
        weight_sum, loss_sum, metric_sums = 0.0, 0.0, None
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for i, piece in enumerate(pieces):
                    if len(piece) and not self.source.holds(piece):  # the coming rows in one read
                        self.source.read_ahead([p for p in pieces[i:i + max(1, READ_AHEAD_SAMPLES // len(piece))]
                                                if len(p)])
                    # a rank short of samples runs a stand-in of weight 0: every rank runs as many forwards
                    batch = self.source.batch(piece if len(piece) else range(0, 1))
                    weight = batch_weight(batch, len(piece)) if len(piece) else 0.0
                    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                    _, value, metrics = checked(call_loss(self.loss_fn, batch), step, finite, where="eval.loss",
                                                needs_grad=False)
                    metric_sums = metric_sums if metric_sums is not None else dict.fromkeys(metrics, 0.0)
                    if sorted(metrics) != sorted(metric_sums):
                        raise ValueError(f"eval.loss: returned metrics {sorted(metrics)} and {sorted(metric_sums)} "
                                         f"in one evaluation: every call must return the same ones")
                    weight_sum += weight
                    loss_sum += value * weight
                    for name, v in metrics.items():
                        metric_sums[name] += v * weight
        finally:
            module.train(was_training)
        metric_sums = metric_sums or {}
        total = step_summary(False, weight_sum, loss_sum, metric_sums, device, where="eval.loss")
        comm.all_reduce(total)
        if float(total[1]) <= 0:
            raise ValueError(f"eval.source: the eval set carries no loss terms (every weight is 0) at step {step}")
        loss, metrics = read_step_summary(total, sorted(metric_sums), world, step, where="eval.loss")
        perplexity = math.exp(loss) if self.token_loss and loss < 700 else None  # exp overflows past ~709
        return EvalResult(step, loss, metrics, self.size, perplexity, round(time.monotonic() - began, 4))
