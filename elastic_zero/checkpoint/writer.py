"""Asynchronous checkpoint saves from the ranks of a generation.

At a safe point a rank hands a host-memory snapshot of its shard to save(); a background thread
writes the rank's file and posts its manifest entry in the job's store; rank 0's thread waits for
every rank's entry and commits the manifest. Training goes on meanwhile; only one save is in
flight per rank, so a new save first waits for the previous one (that wait is the stall).
"""

from __future__ import annotations

import datetime
import json
import threading
import time

from elastic_zero.checkpoint.manifest import datafile_from_dict, datafile_to_dict
from elastic_zero.checkpoint.store import commit, make_manifest, open_store, step_dir, write_rank_file
from elastic_zero.zero.shard import ShardState


class AsyncCheckpointWriter:
    def __init__(self, uri: str, store, keep: int, stage: int, timeout_s: float = 300.0) -> None:
        self.fs, self.root = open_store(uri)
        self.store, self.keep, self.stage, self.timeout_s = store, keep, stage, timeout_s
        self._thread: threading.Thread | None = None
        self._abandon = threading.Event()
        self.committed: list[str] = []  # directories this rank committed (rank 0 only)
        self.errors: list[str] = []

    def save(self, snapshot: ShardState, tag: str, extra: dict, sample_log: list | None = None) -> float:
        """Start saving `snapshot` (a copy no one else mutates); returns the seconds spent waiting
        for the previous save. `tag` names this save uniquely across the job (generation and step);
        `sample_log` rows (what this rank trained on since its last save) go into the manifest."""
        started = time.perf_counter()
        self.wait()
        stall = time.perf_counter() - started
        self._thread = threading.Thread(target=self._write, args=(snapshot, tag, extra, list(sample_log or ())),
                                        daemon=True)
        self._thread.start()
        return stall

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abandon(self) -> None:
        """The generation failed: stop waiting for other ranks' files (that save never commits)."""
        self._abandon.set()
        self.wait()
        self._abandon.clear()

    def _write(self, snapshot: ShardState, tag: str, extra: dict, sample_log: list) -> None:
        try:
            step = int(snapshot.scalars["step"])
            entry = write_rank_file(self.fs, step_dir(self.root, step), snapshot)
            self.store.set(f"ckpt/{tag}/{snapshot.rank}",
                           json.dumps({"file": datafile_to_dict(entry), "sample_log": sample_log}))
            if snapshot.rank != 0:
                return
            world = snapshot.partition.world_size
            keys = [f"ckpt/{tag}/{r}" for r in range(world)]
            deadline = time.monotonic() + self.timeout_s
            while not self.store.check(keys):  # bounded waits, so that abandon() is seen promptly
                if self._abandon.is_set() or time.monotonic() > deadline:
                    self.errors.append(f"{tag}: not every rank wrote its file; not committed")
                    return
                try:
                    self.store.wait(keys, datetime.timedelta(seconds=0.2))
                except Exception:  # the store's wait timed out: look again
                    pass
            posted = [json.loads(self.store.get(k)) for k in keys]
            files = [datafile_from_dict(p["file"]) for p in posted]
            rows = sorted(tuple(row) for p in posted for row in p["sample_log"])
            manifest = make_manifest(snapshot, files, self.stage, {**extra, "sample_log": rows})
            self.committed.append(commit(self.fs, self.root, manifest, self.keep))
        except Exception as exc:  # a failed save must not stop training; the previous checkpoint stands
            self.errors.append(f"{tag}: {type(exc).__name__}: {exc}")
