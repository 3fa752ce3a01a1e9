"""The calls the coordinator's loop waits for (workers' hellos, their train calls): each puts itself
on a queue when it completes, and the loop takes what completed. Not ray.wait over every call in
flight: that costs O(workers) each time, and the loop runs twenty times a second."""

from __future__ import annotations

import queue


class Completions:
    def __init__(self) -> None:
        self._done: queue.Queue = queue.Queue()

    def watch(self, ref) -> None:
        """Have `ref` (an ObjectRef) come out of completed() once it completes, with a value or an error."""
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
