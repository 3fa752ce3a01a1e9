"""The calls the coordinator's loop waits for (workers' hellos, their train calls): each puts itself
on a queue when it completes, and the loop takes what completed. Not ray.wait over every call in
flight: that costs O(workers) each time, and the loop runs twenty times a second.

Told by ObjectRef._on_ready where this Ray has it (Ray Serve waits on replicas' answers the same
way): it fetches and deserializes nothing, while ref.future() made a Future, a Condition and an
RLock for each call and deserialized each report in Ray's callback thread, to be deserialized again
by ray.get (at 1,024 simulated workers: 42% of the coordinator loop's GIL time from a node's loss
until the survivors held their plans; measured alone, 1,024 completions cost 0.34-0.41 s of the
caller's CPU told this way, 0.49-0.55 s through futures)."""

from __future__ import annotations

import queue


class Completions:
    def __init__(self) -> None:
        self._done: queue.Queue = queue.Queue()

    def watch(self, ref) -> None:
        """Have `ref` (an ObjectRef, kept by the caller until it is taken) come out of completed() once
        it completes, with a value or an error."""
        on_ready = getattr(ref, "_on_ready", None)
        if on_ready is not None:
            on_ready(lambda _error: self._done.put(ref))  # an error is the value: ray.get raises it
        else:  # a Ray without it
            ref.future().add_done_callback(lambda _: self._done.put(ref))

    def completed(self, timeout_s: float) -> list:
        """The watched calls that completed, waiting up to `timeout_s` for the first."""
        try:
            done = [self._done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self._done.empty():
            done.append(self._done.get_nowait())
        return done
