"""Control of a running job through its coordinator (a named actor): status, scale, stop.

`call` talks to the coordinator from a process connected to the cluster (`ray.init`). A client that
has only the cluster's Jobs API address (http://HEAD:8265) runs this module there as a short job
(`control_entrypoint`: `main(OP, JOB, ARGS)`), which prints the answer on one marked line.
"""

from __future__ import annotations

import json
import sys

from elastic_zero.service.submission import control_answer

OPS = ("status", "scale", "stop")


class NoSuchJob(ValueError):
    pass


def call(op: str, job_id: str, address: str | None = "auto", **args):
    import ray

    from elastic_zero.coordinator.actor import NAMESPACE, coordinator_name

    if op not in OPS:
        raise ValueError(f"unknown control operation {op!r}; known: {', '.join(OPS)}")
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    try:
        actor = ray.get_actor(coordinator_name(job_id), namespace=NAMESPACE)
    except ValueError:
        final = _final_status(job_id)
        if op == "status" and final is not None:
            return final
        raise NoSuchJob(f"no running elastic-zero job {job_id!r} on this Ray cluster"
                        + (f" (it is {final['state']})" if final else "")) from None
    try:
        if op == "status":
            try:
                return ray.get(actor.status.remote(), timeout=30)
            except ray.exceptions.ActorUnavailableError:
                raise ValueError(f"the coordinator of {job_id!r} is restarting; ask again in a few seconds") from None
            except ray.exceptions.RayActorError:  # it went (a finished one lingers a while) as we asked
                final = _final_status(job_id)
                if final is None:
                    raise NoSuchJob(f"the coordinator of {job_id!r} is gone and left no status (if its driver "
                                    f"is restarting it, ask again in a few seconds)") from None
                return final
        if op == "scale":
            return ray.get(actor.scale.remote(int(args["workers"])), timeout=30)
        return ray.get(actor.stop.remote(bool(args.get("checkpoint"))), timeout=30)
    except ray.exceptions.RayTaskError as exc:  # the coordinator refused: its ValueError's one line
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        raise ValueError(str(cause).strip().splitlines()[-1]) from None
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        raise ValueError(f"the coordinator of {job_id!r} did not answer (it is restarting or gone); "
                         f"ask again in a few seconds") from None


def _final_status(job_id: str) -> dict | None:
    from ray.experimental.internal_kv import _internal_kv_get

    from elastic_zero.coordinator.face import NAMESPACE_KV
    from elastic_zero.observe.live import final_status_key

    value = _internal_kv_get(final_status_key(job_id), namespace=NAMESPACE_KV)
    return json.loads(value) if value else None


def main(argv: list[str]) -> int:
    op, job_id, args = argv[0], argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    try:
        value = call(op, job_id, "auto", **args)
    except NoSuchJob as exc:
        print(control_answer(error=str(exc), missing=True))
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure is the answer, in one line
        print(control_answer(error=str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))
        return 0
    print(control_answer(value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
