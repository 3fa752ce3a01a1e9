"""The coordinator's side of the simulated workers (sim_workers.py): its workforce
(coordinator/workforce.py's seam) spawns them on simulated hosts and hands back handles that
answer `handle.method.remote(*args)` as a Ray actor handle does, each call going to the host."""

from __future__ import annotations

from elastic_zero.testing.sim_workers import SIM_NODE_FORMAT


class SimulatedHandle:
    """What the coordinator holds for a simulated worker: `handle.train.remote(plan)` and the rest,
    as on a Ray actor handle, each answered by its host."""

    def __init__(self, host, actor_id: str) -> None:
        self._host, self.actor_id = host, actor_id
        self._call = host.call  # Ray makes a method object at each lookup: thousands per generation here

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return _RemoteMethod(self._call, self.actor_id, method)


class _RemoteMethod:
    """`handle.method`: its `.remote(*args)` is the host's call."""

    __slots__ = ("_call", "_actor_id", "_method")

    def __init__(self, call, actor_id: str, method: str) -> None:
        self._call, self._actor_id, self._method = call, actor_id, method

    def remote(self, *args):
        return self._call.remote(self._actor_id, self._method, *args)


class SimulatedWorkforce:
    """The coordinator's workforce (coordinator/workforce.py) for the bench: workers fill simulated
    nodes of `per_node` in spawn order, a node to a host in turn; a node the coordinator keeps new
    workers off (its label selector) gets no more."""

    def __init__(self, hosts: list, per_node: int) -> None:
        self.hosts, self.per_node = list(hosts), per_node
        self._node, self._on_node = 0, 0

    def spawn(self, options: dict, **worker_args):
        avoided = _avoided_nodes(options)
        if self._on_node == self.per_node or SIM_NODE_FORMAT.format(self._node) in avoided:
            self._node, self._on_node = self._node + 1, 0
        node = SIM_NODE_FORMAT.format(self._node)
        self._on_node += 1
        host = self.hosts[self._node % len(self.hosts)]
        actor_id = worker_args["actor_id"]
        host.spawn.remote(actor_id, node, {k: v for k, v in worker_args.items() if k != "actor_id"})
        return SimulatedHandle(host, actor_id)

    def kill(self, handle: SimulatedHandle) -> None:
        handle._host.kill.remote(handle.actor_id)


def _avoided_nodes(options: dict) -> set[str]:
    """The nodes a spawn's label selector keeps the worker off ("!in(a,b)")."""
    selector = (options.get("label_selector") or {}).get("ray.io/node-id", "")
    if not selector.startswith("!in("):
        return set()
    return set(selector[4:-1].split(","))
