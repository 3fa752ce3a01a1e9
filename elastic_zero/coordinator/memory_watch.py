"""What the coordinator knows of its workers' memory, put together from their hellos and beats into
the MemoryView its state machine plans with (plan/memory.py, coordinator/memory_rules.py).

- A hello says the worker's node's capacity and Ray's threshold there, the worker's RSS beside its
  model's own tensors, its device (and a GPU's memory), and the model's state facts (the same from
  every worker). A node whose capacity could not be read is left out: its room is not known.
- Each beat carries the worker's RSS, its peak since it began its generation's steps, and its node's
  used memory: a node's other processes hold its used memory less this job's workers' RSS. Each
  worker's RSS is in the view too (`held`): one outside the plan (a standby) weighs on its node's room.
- What a worker holds beside its state is measured in each generation, once the worker has stepped
  twice since the first beat heard of it there: its peak less the state it holds in the node's memory
  (the engine's, where it is not on a GPU, and the replicas: all four copies of a swap, which the
  measured steps saw at least once). The latest generation measured is the one planned with. Before
  any: its RSS at hello beside the model's tensors and half of it again (the heap and activations of
  the steps), and five of the model's largest unit (gathered, prefetched, buckets). Measured so,
  GPT-2 medium's shape held 1.66 GiB beside its state against 1.70 estimated; a 12M GPT 0.58 against
  0.64.
- A worker killed by Ray's memory monitor shows that its plan's shape needs more than its node
  had: no plan of that shape counts on that room again (MemoryView.killed).
"""

from __future__ import annotations

from elastic_zero.plan.memory import GIB, MemoryView, NodeRoom

FADING_S = 30.0  # the longest a retired worker's memory is taken to be on its way out


class MemoryWatch:
    def __init__(self, node_limit_bytes: int | None = None) -> None:
        """`node_limit_bytes`: the most the job's workers may hold on one node together (elastic.memory_per_node_gib)."""
        self.node_limit = node_limit_bytes
        self.model = None
        self.nodes: dict[str, tuple[int, float]] = {}  # node -> (capacity, threshold)
        self.device_room = 0  # the least a worker's GPU has (0: no GPU)
        self.node_of: dict[str, str] = {}  # actor id -> node
        self.base: dict[str, int] = {}  # actor id -> RSS at hello beside its model's own tensors
        self.measured: dict[int, int] = {}  # generation -> the most a worker held beside its state there
        self._first_steps: dict[tuple, int] = {}  # (actor id, generation) -> its steps at its first beat there
        self.floors: dict = {}
        self.peaks: dict[str, int] = {}  # actor id -> its highest peak heard, the whole job
        self.fading: dict[str, tuple[str, float]] = {}  # actor id -> (node, when): retired, not heard to end

    def hello(self, actor_id: str, node: str, facts: dict) -> None:
        if not facts:
            return
        self.node_of[actor_id] = node
        if facts.get("capacity", 0) > 0:
            self.nodes[node] = (facts["capacity"], facts["threshold"])
        if facts.get("device_capacity"):
            room = int(facts["device_capacity"] * 0.95)
            self.device_room = min(self.device_room, room) if self.device_room else room
        self.base[actor_id] = max(0, facts.get("rss", 0) - facts.get("own_tensors", 0))
        if self.model is None and facts.get("model") is not None:
            self.model = facts["model"]

    def forget(self, actor_id: str, now: float = 0.0) -> None:
        """A worker retired: its node's memory is no longer its (its peak stays in the summary). Until
        its beat process's last word says its process ended (for FADING_S at the most), what it still
        holds is on its way out: neither the node's others nor any plan's (read as others, a retired
        standby's memory would retire the next standby for room the first one is giving back)."""
        node = self.node_of.pop(actor_id, None)
        self.base.pop(actor_id, None)
        if node is not None:
            self.fading[actor_id] = (node, now)

    def view(self, progress: dict, plan=None, now: float = 0.0) -> MemoryView | None:
        """The view from the beats heard (`progress`: actor id -> heartbeats.Progress, which the
        listener's thread adds to: a copy is read) and the running `plan` (its members' peaks
        measure what they hold beside the state)."""
        if self.model is None:
            return None
        progress = dict(progress)
        for actor_id, p in progress.items():
            if p.peak:
                self.peaks[actor_id] = max(self.peaks.get(actor_id, 0), p.peak)
        if plan is not None:
            self._measure(progress, plan)
        used, ours = dict.fromkeys(self.nodes, 0), dict.fromkeys(self.nodes, 0)  # per node, in one pass
        held = {}  # what each worker holds, where its node's used memory counts it as ours
        for actor_id, node in self.node_of.items():
            p = progress.get(actor_id)
            if p is not None and not p.last_word and node in used:
                used[node], ours[node] = max(used[node], p.node_used), ours[node] + p.rss
                held[actor_id] = p.rss
        for actor_id, (node, since) in list(self.fading.items()):
            p = progress.get(actor_id)
            if p is None or p.last_word or now - since > FADING_S:  # (no last word from a vanished node)
                del self.fading[actor_id]
            elif node in ours:
                ours[node] += p.rss
        rooms = {}
        for node, (capacity, threshold) in self.nodes.items():
            room = NodeRoom(capacity, threshold, max(0, used[node] - ours[node]))
            if self.node_limit is not None and self.node_limit < room.room:
                room = NodeRoom(self.node_limit, 1.0, 0)
            rooms[node] = room
        if self.measured:
            overhead, measured = self.measured[max(self.measured)], True
        else:
            overhead, measured = max(self.base.values(), default=0) * 3 // 2 + self.model.working_bytes(), False
        return MemoryView(self.model, rooms, overhead, dict(self.floors), self.device_room, measured, held)

    def _measure(self, progress: dict, plan) -> None:
        world = plan.generation.world_size
        state = self.model.state_bytes(world, plan.replicas, on_device=bool(self.device_room))
        for m in plan.generation.members:
            p = progress.get(m.actor_id)
            if p is None or p.generation != plan.number or not p.peak or p.last_word:
                continue
            first = self._first_steps.setdefault((m.actor_id, plan.number), p.steps)
            if p.steps >= first + 2:
                self.measured[plan.number] = max(self.measured.get(plan.number, 0), p.peak - state)

    def killed(self, view: MemoryView, plan) -> MemoryView:
        """A worker of `plan`'s generation was killed for memory: the view that no plan of its shape
        fits the room each of its node's workers had."""
        world = plan.generation.world_size
        nodes = [m.node for m in plan.generation.members]
        room = view.verdict(world, nodes, plan.replicas, self._beside(view, plan)).room
        taught = view.killed(world, plan.replicas, room)
        self.floors = dict(taught.floors)
        return taught

    def _beside(self, view: MemoryView, plan) -> dict:
        """node -> what the job's workers outside `plan` (a standby, a joiner not in yet) hold there."""
        members = {m.actor_id for m in plan.generation.members}
        return view.held_on_nodes((a, n) for a, n in self.node_of.items() if a not in members)

    def summary(self, view: MemoryView | None, plan=None) -> dict:
        """The summary's and the status's memory: each worker's peak, and what the plan counted on."""
        out = {"peak_rss_gib": {a: round(b / GIB, 3) for a, b in sorted(self.peaks.items())}}
        if view is not None and plan is not None:
            world = plan.generation.world_size
            beside = self._beside(view, plan)
            verdict = view.verdict(world, [m.node for m in plan.generation.members], plan.replicas, beside)
            out["plan"] = {"generation": plan.number, "workers": world, "replicas": plan.replicas,
                           "engine_gib": round(view.model.engine_bytes(world) / GIB, 3),
                           "replicas_gib": round(view.model.replica_bytes(world, pinned=bool(view.device_room)) / GIB, 3)
                           if plan.replicas else 0.0,
                           "beside_state_gib": round(view.overhead / GIB, 3), "measured": view.measured,
                           "need_gib": round(verdict.need / GIB, 3), "room_gib": round(verdict.room / GIB, 3),
                           "outside_plan_gib": round(beside.get(verdict.node, 0) / GIB, 3)}
            if view.device_room:
                out["plan"].update(device_need_gib=round(verdict.device_need / GIB, 3),
                                   device_room_gib=round(view.device_room / GIB, 3))
        return out
