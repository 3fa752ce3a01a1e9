"""Where the coordinator's workers come from: the one seam between the coordinator and the processes
that train. The coordinator spawns through it and kills through it; everything else it does to a
worker is a call on the handle spawn() returned (`handle.train.remote(plan)`, ...), answered with the
protocol's records (protocol.py).

RayWorkforce makes one Ray actor per worker (TrainingWorker): what every real job uses. Its workers
are detached and named after the job's coordinator, so that they outlive a coordinator that dies
and its replacement finds them (survivors) and takes them over from their memory (takeover.py); the
coordinator retires them as the job ends, and a driver that stops the job takes any left (driver.py).
The control plane's bench (bench/control_plane.py) passes a workforce of simulated workers, many to a
process, that speak the same protocol on a fake step clock, so that the coordinator under test is
the code that runs real jobs.
"""

from __future__ import annotations

import ray


def worker_name_prefix(coordinator: str) -> str:
    """What the names of a job's workers start with (`coordinator`: its coordinator's name)."""
    return f"{coordinator}/"


def named_workers(coordinator: str, namespace: str) -> dict[str, object]:
    """The job's workers alive now, by actor id: their handles, found by name."""
    prefix = worker_name_prefix(coordinator)
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):  # (the caller's own may be another)
        name = entry["name"]
        if entry["namespace"] == namespace and name.startswith(prefix):
            try:
                found[name[len(prefix):]] = ray.get_actor(name, namespace=namespace)
            except ValueError:  # gone since it was listed
                pass
    return found


class RayWorkforce:
    """One Ray actor per worker, placed by Ray (`options`: resources, a label selector), named after
    `coordinator` in `namespace` (the coordinator's own)."""

    def __init__(self, coordinator: str, namespace: str) -> None:
        from elastic_zero.worker.actor import TrainingWorker  # a torch-free face

        self._cls = ray.remote(TrainingWorker)
        self._coordinator, self._namespace = coordinator, namespace

    def spawn(self, options: dict, **worker_args):
        """A new worker, `worker_args` as TrainingWorker takes them; `options`: where it may run."""
        name = worker_name_prefix(self._coordinator) + worker_args["actor_id"]
        return self._cls.options(max_concurrency=4, name=name, namespace=self._namespace, lifetime="detached",
                                 **options).remote(**worker_args)

    def survivors(self) -> dict[str, object]:
        """The workers of the job still alive (a lost coordinator's, by actor id)."""
        return named_workers(self._coordinator, self._namespace)

    def kill(self, handle) -> None:
        ray.kill(handle, no_restart=True)
