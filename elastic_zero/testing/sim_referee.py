"""The step at which every simulated member of a generation stops for its safe point
(sim_workers.py): the referee real ranks do without, since the step's closing all-reduce carries one
rank's request to all."""

from __future__ import annotations


class StepReferee:
    """The step every member of a generation stops at for its safe point: the first proposal wins,
    and every host hears it. A Ray actor; it stands in for the step's all-reduce, which spans the
    hosts and carries one rank's request to all (the coordinator asks one member)."""

    def __init__(self) -> None:
        self._agreed: dict[int, int] = {}
        self._hosts: list = []

    def know_hosts(self, hosts: list) -> None:
        self._hosts = list(hosts)

    def agree(self, generation: int, proposed: int) -> int:
        if generation not in self._agreed:
            self._agreed[generation] = proposed
            for host in self._hosts:
                host.stop_at.remote(generation, proposed)
        return self._agreed[generation]
