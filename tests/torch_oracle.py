"""The runtime tests' oracle: torch's own AdamW on one process, over the batches a job of
runtime_jobs.job_spec trains on, with neither Ray nor the engine. A job's final weights after kills,
scale-ups and hand-offs must come within the tests' bound (1e-4, relative) of these; a one-worker job
comes within 4e-6 of them at 400 steps (measured here), the reduction order's rounding."""

import torch

from elastic_zero.job.build import build_model, build_source
from elastic_zero.losses import next_token_loss
from elastic_zero.plan.batches import rank_positions
from runtime_jobs import job_spec


class AdamWTrajectory:
    """One uninterrupted run at one global batch, carried on as later steps are asked for (a step
    asked for below the one reached starts it over: the same batches, the same weights)."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self._start()

    def _start(self) -> None:
        spec = job_spec("oracle", train={"global_batch": self.global_batch})
        self._model = build_model(spec)
        o = spec.optimizer
        assert o.name == "adamw" and o.schedule == "constant", o  # what this loop does
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                            weight_decay=o.weight_decay)
        self._source, self._clip, self.step = build_source(spec, self._model), spec.train.grad_clip, 0

    def weights_at(self, steps: int) -> dict[str, torch.Tensor]:
        """The weights after `steps` optimizer steps. One forward over the whole global batch: its mean
        loss is the job's (the mean over the global batch's target tokens, whatever its micro batches)."""
        if steps < self.step:
            self._start()
        while self.step < steps:
            self._optimizer.zero_grad()
            batch = self._source.batch(rank_positions(self.step, self.global_batch, 1, 0))
            next_token_loss(self._model, batch).backward()
            if self._clip is not None:
                torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._clip)
            self._optimizer.step()
            self.step += 1
        return {name: value.detach().clone() for name, value in self._model.state_dict().items()}
