"""The runtime tests' oracle: torch's own AdamW on one process, over the batches a job trains on
(runtime_jobs.job_spec's, or any spec's), with neither Ray nor the engine. A job's final weights after kills,
scale-ups and hand-offs must come within the tests' bound (1e-4, relative) of these; a one-worker job
comes within 4e-6 of them at 400 steps (measured here), the reduction order's rounding."""

from typing import Callable

import torch

from elastic_zero.job.build import build_loss, build_model, build_source
from elastic_zero.job.spec import JobSpec
from elastic_zero.plan.batches import rank_positions


class AdamWTrajectory:
    """One uninterrupted run of a job's spec, carried on as later steps are asked for (a step asked for
    below the one reached starts it over: the same batches, the same weights)."""

    def __init__(self, spec: JobSpec, model: Callable[[], torch.nn.Module] | None = None) -> None:
        """`model`: the model as the job starts from it (default: the spec's, by its seed; give one
        where the job's workers load `model.init_from`)."""
        o = spec.optimizer
        if o.name != "adamw" or o.schedule != "constant":
            raise ValueError(f"the oracle runs AdamW at a constant rate, not {o.name} with {o.schedule}")
        self._spec, self._build = spec, model or (lambda: build_model(spec))
        self._start()

    def _start(self) -> None:
        spec, o = self._spec, self._spec.optimizer
        self._model = self._build()
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                            weight_decay=o.weight_decay)
        self._loss, self._source, self.step = build_loss(spec), build_source(spec, self._model), 0

    def weights_at(self, steps: int) -> dict[str, torch.Tensor]:
        """The weights after `steps` optimizer steps. One forward over the whole global batch: its mean
        loss is the job's (the mean over the global batch's target tokens, whatever its micro batches)."""
        if steps < self.step:
            self._start()
        batch_size, clip = self._spec.train.global_batch, self._spec.train.grad_clip
        while self.step < steps:
            self._optimizer.zero_grad()
            self._loss(self._model, self._source.batch(rank_positions(self.step, batch_size, 1, 0))).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(self._model.parameters(), clip)
            self._optimizer.step()
            self.step += 1
        return {name: value.detach().clone() for name, value in self._model.state_dict().items()}
