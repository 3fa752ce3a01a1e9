"""What a worker builds as it starts, before any generation: its device, its model (with its wrap
and optimizer: worker_model.py), its data source and the batches cut from it, its loss and its
evaluator. Each phase is timed on the worker's StartClock (start_clock.py). An error raises, naming
the field where the user's code or data failed; the trainer keeps it for its hello to tell."""

from __future__ import annotations

from typing import NamedTuple

import torch

from elastic_zero.job.build import build_loss, build_optimizer, build_source
from elastic_zero.worker.device import worker_device
from elastic_zero.worker.evaluation import Evaluator
from elastic_zero.worker.faults import named
from elastic_zero.worker.initial_model import initial_model
from elastic_zero.worker.start_clock import StartClock
from elastic_zero.worker.step_batches import StepBatches
from elastic_zero.worker.worker_model import WorkerModel
from elastic_zero.zero.host_memory import release_free_memory


class StartParts(NamedTuple):
    device: torch.device
    held: WorkerModel
    source: object  # data/source.py: the job's training data
    batches: StepBatches
    loss_fn: object
    evaluator: Evaluator | None


def build_start_parts(spec, clock: StartClock, joiner: bool = False) -> StartParts:
    """`joiner`: a worker joining a running job, whose model is a skeleton (initial_model.py)."""
    device = worker_device(spec.elastic.use_gpu)
    clock.lap("device")
    built = initial_model(spec, device, skeleton=joiner)
    source = named("data.source", lambda: build_source(spec, built.model))
    t = spec.train
    batches = StepBatches(source, t.global_batch, t.micro_batch, t.steps, device)
    loss_fn = build_loss(spec)
    evaluator = named("eval.source", lambda: Evaluator(spec, built.model)) if spec.eval.source else None
    held = WorkerModel(spec, device, build_optimizer(spec), built)
    release_free_memory()  # a meta model's construction made and freed every parameter
    clock.lap("model")
    return StartParts(device, held, source, batches, loss_fn, evaluator)
