"""What a worker will hold, and whether its node has room for it: the memory side of a generation's
plan. Pure: the coordinator feeds it what the workers measured (their hello, their beats).

A worker of a generation of `world` ranks holds
- its engine's state (the layout fixes it: the fp32 master, gradient and optimizer shards, and at
  stages 1-2 the full parameters in the compute dtype, at stage 1 the full gradients too);
- with replicas, its own snapshot and its ward's (the parameters and the optimizer's vectors of a
  shard: 12 bytes a parameter of its shard with AdamW), two of each while a swap is in flight;
- and what does not shrink with the world: the interpreter and its libraries, the activations, the
  units gathered and their gradient buckets. That part is measured: a worker's peak RSS in a
  generation, less the state it was modelled to hold there (before any step, an estimate from its
  RSS at hello: coordinator/memory_watch.py).

A node has room for its workers together: Ray's memory monitor kills past `threshold` of its
capacity, and what else runs there (other jobs, Ray itself) is taken off first, as is what the
job's own workers outside a plan hold there (a standby: its interpreter and its model). On a GPU
the engine's state is on the device, not the node: the node holds the replicas and what is beside
the state, and the device the engine's state and the units at work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30
WORKING_UNITS = 5  # of the largest unit: gathered (with the next one prefetched) and buckets in flight


@dataclass(frozen=True)
class ModelMemory:
    """The model's state as the engine lays it out (the same on every worker)."""

    unit_numels: tuple[int, ...]  # each unit's elements
    stage: int
    compute_bytes: int  # 4 (fp32), 2 (bf16, fp16)
    state_vectors: int  # the optimizer's vectors beside the parameters (AdamW: 2, SGD with momentum: 1)

    def shard_numel(self, world: int) -> int:
        return sum(-(-n // world) for n in self.unit_numels)

    def engine_bytes(self, world: int) -> int:
        """The engine's state on one rank (what its memory_report counts)."""
        shard = self.shard_numel(world)
        full = shard * world  # every unit padded to `world` chunks
        master = shard * 4 if self.stage == 3 or self.compute_bytes != 4 else 0  # else a view of the full buffer
        held = master + shard * 4 + self.state_vectors * shard * 4  # master, gradient and optimizer shards
        if self.stage in (1, 2):
            held += full * self.compute_bytes
        if self.stage == 1:
            held += full * self.compute_bytes
        return held

    def snapshot_bytes(self, world: int, pinned: bool = False) -> int:
        """One copy of a rank's shard: its parameters and optimizer vectors in fp32, a buffer each.
        `pinned` (a GPU's own copies, off the device): torch's caching host allocator gives each
        buffer a block of the next power of two bytes (CachingHostAllocator.h: PowerOf2Ceil, below
        `pinned_max_round_threshold`, unlimited by default)."""
        vector = self.shard_numel(world) * 4
        return (1 + self.state_vectors) * (pinned_block_bytes(vector) if pinned else vector)

    def replica_bytes(self, world: int, pinned: bool = False) -> int:
        """The most a rank's replicas hold: its own and its ward's copies, two of each during a swap
        (`pinned`: its own in pinned blocks, on a GPU; the ward's arrive in plain host memory)."""
        return 2 * self.snapshot_bytes(world, pinned) + 2 * self.snapshot_bytes(world)

    def working_bytes(self) -> int:
        """The units gathered and their gradient buckets at once, as an estimate before it is measured."""
        return WORKING_UNITS * max(self.unit_numels, default=0) * max(self.compute_bytes, 4)

    def state_bytes(self, world: int, replicas: bool, on_device: bool = False) -> int:
        """What a worker's state holds of its node's memory: the engine's (unless `on_device`: a GPU
        holds it) and the replicas (pinned on a GPU)."""
        return (0 if on_device else self.engine_bytes(world)) + \
            (self.replica_bytes(world, pinned=on_device) if replicas else 0)


def pinned_block_bytes(n: int) -> int:
    """The block torch's caching host allocator gives a pinned buffer of `n` bytes: the next power of two."""
    return 1 << (n - 1).bit_length() if n > 1 else n


@dataclass(frozen=True)
class NodeRoom:
    """A node's memory as Ray's monitor sees it: it kills above `threshold` of `capacity`."""

    capacity: int
    threshold: float
    others: int = 0  # what the node's other processes hold (not this job's workers)

    @property
    def room(self) -> int:
        return max(0, int(self.capacity * self.threshold) - self.others)


@dataclass(frozen=True)
class Verdict:
    """Whether a plan's workers fit their nodes: with replicas, without them, or not at all."""

    fits: bool
    replicas: bool  # the plan keeps replicas (asked for, and they fit)
    need: int  # bytes a worker will hold at the most, as planned (with the replicas kept)
    need_with_replicas: int
    room: int  # bytes a worker of the tightest node may hold
    node: str  # that node
    device_need: int = 0  # on a GPU: what the engine holds there
    device_room: int = 0  # and what the device has for it (0: no device)

    def line(self, world: int) -> str:
        """One line with the numbers, for a warning or a refusal."""
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        if self.device_room and self.device_need > self.device_room:
            return (f"at {world} worker(s) each would hold {gib(self.device_need)} on its GPU, which has "
                    f"{gib(self.device_room)}")
        if not self.fits:
            return (f"at {world} worker(s) each would hold {gib(self.need)} (without replicas), and node {self.node[:12]} "
                    f"has {gib(self.room)} for each of its workers")
        return (f"replicas dropped at {world} worker(s): each would hold {gib(self.need_with_replicas)} with them, "
                f"{gib(self.need)} without, and node {self.node[:12]} has {gib(self.room)} for each of its workers")


@dataclass(frozen=True)
class MemoryView:
    """What the coordinator knows of memory: the model, each node's room, the part of a worker that
    does not shrink with the world (measured, or estimated until then), and a floor a memory kill
    taught (see killed()). On a GPU (`device_room` > 0) the engine's state counts against the device."""

    model: ModelMemory
    rooms: dict  # node -> NodeRoom
    overhead: int  # bytes beside the state
    floors: dict = None  # (world, replicas) -> the least a worker of that shape is taken to need (a kill taught it)
    device_room: int = 0  # bytes a worker's GPU has for the engine (0: the engine is in the node's memory)
    measured: bool = False  # the overhead was measured in a generation that stepped (else an estimate)
    # actor id -> what a worker holds now, by its beats (a node's room is net of the job's workers:
    # one outside a plan, a standby, weighs on its node's room beside that plan's workers)
    held: dict = None

    def need(self, world: int, replicas: bool) -> int:
        """What a worker will hold of its node's memory at the most."""
        planned = self.model.state_bytes(world, replicas, on_device=bool(self.device_room)) + self.overhead
        floor = (self.floors or {}).get((world, replicas))
        return max(planned, floor) if floor is not None else planned

    def device_need(self, world: int) -> int:
        """What a worker will hold of its GPU's memory: the engine's state and the units at work."""
        return self.model.engine_bytes(world) + self.model.working_bytes() if self.device_room else 0

    def verdict(self, world: int, nodes: list[str], replicas: bool, beside: dict | None = None) -> Verdict:
        """Whether `world` workers on `nodes` (one entry per worker) fit: with replicas if asked and
        they fit, else without. `beside`: node -> bytes the job's workers outside the plan hold there."""
        counts: dict[str, int] = {}
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
        beside = beside or {}
        room_of = lambda n: max(0, self._room_of(n) - beside.get(n, 0))  # noqa: E731
        tight = min(counts, key=lambda n: room_of(n) // counts[n]) if counts else ""
        room = room_of(tight) // counts[tight] if counts else 0
        with_replicas = self.need(world, True)
        without = self.need(world, False)
        device = self.device_need(world)
        on_device = device <= self.device_room if self.device_room else True
        if replicas and with_replicas <= room and on_device:
            return Verdict(True, True, with_replicas, with_replicas, room, tight, device, self.device_room)
        return Verdict(without <= room and on_device, False, without, with_replicas, room, tight, device,
                       self.device_room)

    def held_on_nodes(self, workers) -> dict:
        """node -> what `workers` ((actor id, node) pairs) hold there now, by their beats."""
        on: dict[str, int] = {}
        for actor_id, node in workers:
            on[node] = on.get(node, 0) + (self.held or {}).get(actor_id, 0)
        return on

    def _room_of(self, node: str) -> int:
        room = self.rooms.get(node)
        return room.room if room is not None else 2**62  # a node not heard of yet: no limit known

    def smallest_world(self, nodes_in_order: list[str], most: int) -> int | None:
        """The fewest workers, placed on `nodes_in_order` (the candidates' nodes, in the order they
        would join), that fit without replicas; None if not even `most` do."""
        return self._first_fitting(range(1, min(most, len(nodes_in_order)) + 1), nodes_in_order)

    def largest_world(self, nodes_in_order: list[str], least: int, most: int) -> int | None:
        """The most workers in [least, most], placed on `nodes_in_order`, that fit without replicas
        (on a node shared by several, each worker's overhead adds up: more workers may fit worse);
        None if none does."""
        return self._first_fitting(range(min(most, len(nodes_in_order)), max(least, 1) - 1, -1), nodes_in_order)

    def _first_fitting(self, worlds: range, nodes_in_order: list[str]) -> int | None:
        """The first of `worlds` whose workers, the first that many of `nodes_in_order`, fit without replicas."""
        return next((w for w in worlds if self.verdict(w, nodes_in_order[:w], replicas=False).fits), None)

    def killed(self, world: int, replicas: bool, room: int) -> "MemoryView":
        """A worker of a generation of `world` (with or without replicas) was killed for memory where
        each worker of its node had `room`: the plan was wrong about that shape (the activations, or
        a neighbour, took more than measured), so no plan of it may count on that room again."""
        floors = dict(self.floors or {})
        floors[(world, replicas)] = max(floors.get((world, replicas), 0), room + 1)
        return replace(self, floors=floors)
