"""Ray's own node draining (`ray drain-node`, an autoscaler taking a node away, `ray start --block`
stopping on SIGTERM) read as notices. Ray has no public API for this: the one private call lives
here, and when it is missing or fails the other sources still work (said once)."""

from __future__ import annotations

from elastic_zero.preemption.notices import Notice


class RayDrains:
    def __init__(self) -> None:
        self.problem: str | None = None  # set once the private call proved unusable

    def draining(self) -> dict[str, Notice]:
        """{node id: notice} for the nodes Ray drains now (deadline None where Ray knows none)."""
        if self.problem is not None:
            return {}
        try:
            import ray._private.state

            drains = ray._private.state.state.get_draining_nodes()  # {node hex: deadline ms, 0 = none}
        except (ImportError, AttributeError, TypeError) as exc:  # the private API moved: give up on it
            self.problem = f"Ray's draining nodes cannot be read ({type(exc).__name__}: {exc})"[:300]
            return {}
        except Exception:  # noqa: BLE001 - a GCS hiccup: the next poll asks again
            return {}
        return {node: Notice("ray-drain", deadline_ms / 1000.0 if deadline_ms else None, "Ray drains the node")
                for node, deadline_ms in dict(drains).items()}
