"""The job's events: kept in memory for the live view and appended to RUN_DIR/events.jsonl as they
happen, so the file is whole even when the coordinator dies, and a restarted coordinator goes on
from what its predecessor wrote."""

from __future__ import annotations

import json
import os
import threading
import time

from elastic_zero.observe.event_kinds import check


def read_events(run_dir: str) -> list[dict]:
    """A run's events, as its EventLog wrote them to RUN_DIR/events.jsonl."""
    with open(os.path.join(run_dir, "events.jsonl")) as fh:
        return [json.loads(line) for line in fh]


class EventLog:
    def __init__(self, run_dir: str, go_on: bool = False) -> None:
        """`go_on`: a restarted coordinator's log, which keeps its predecessor's records first."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "events.jsonl")
        self.records: list[dict] = []
        self._lock = threading.Lock()  # the coordinator's loop and its callers' threads both log
        if go_on and os.path.exists(self.path):
            with open(self.path) as fh:
                for line in fh:
                    try:
                        self.records.append(json.loads(line))
                    except ValueError:  # a line cut short by the predecessor's death
                        pass
        with open(self.path + ".tmp", "w") as fh:  # rewritten whole (a torn last line goes away), then swapped in
            fh.writelines(json.dumps(record) + "\n" for record in self.records)
        os.replace(self.path + ".tmp", self.path)
        self._fh = open(self.path, "a")
        self.listener = None  # told of each record added (the job's trackers)

    def add(self, kind: str, **fields) -> dict:
        check(kind, fields)  # the kinds and their fields are declared once (event_kinds.py)
        record = {"t": round(time.time(), 4), "event": kind, **fields}
        line = json.dumps(record)  # every record must be plain data
        with self._lock:  # the same order in memory and in the file
            self.records.append(record)
            self._fh.write(line + "\n")
            self._fh.flush()
        if self.listener is not None:
            self.listener(record)
        return record

    def since(self, cursor: int) -> list[dict]:
        return self.records[cursor:]

    def count(self, kind: str) -> int:
        return sum(1 for r in self.records if r.get("event") == kind)
