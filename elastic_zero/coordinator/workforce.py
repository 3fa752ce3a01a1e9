"""Where the coordinator's workers come from: the one seam between the coordinator and the processes
that train. The coordinator spawns through it and kills through it; everything else it does to a
worker is a call on the handle spawn() returned (`handle.train.remote(plan)`, ...), answered with the
protocol's records (protocol.py).

RayWorkforce makes one Ray actor per worker (TrainingWorker): what every real job uses. The control
plane's bench (bench/control_plane.py) passes a workforce of simulated workers, many to a process,
that speak the same protocol on a fake step clock, so that the coordinator under test is the code
that runs real jobs.
"""

from __future__ import annotations

import ray


class RayWorkforce:
    """One Ray actor per worker, placed by Ray (`options`: resources, a label selector)."""

    def __init__(self) -> None:
        from elastic_zero.worker.actor import TrainingWorker  # a torch-free face

        self._cls = ray.remote(TrainingWorker)

    def spawn(self, options: dict, **worker_args):
        """A new worker, `worker_args` as TrainingWorker takes them; `options`: where it may run."""
        return self._cls.options(max_concurrency=4, **options).remote(**worker_args)

    def kill(self, handle) -> None:
        ray.kill(handle, no_restart=True)
