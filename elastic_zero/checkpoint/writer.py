"""Asynchronous checkpoint saves from the ranks of a generation.

At a safe point a rank hands a host-memory snapshot of its shard to save(); a background thread
writes the rank's file and posts its manifest entry in the job's store; rank 0's thread waits for
every rank's entry and commits the manifest. Training goes on meanwhile; only one save is in
flight per rank, so a new save first waits for the previous one (that wait is the stall).

Rank 0 picks the save's directory (the step's first one with no commit: a committed checkpoint is
never rewritten, not even by a replay of its step) and posts it; the other ranks write there.
abandon() returns at once: the abandoned save stops at its next wait and never commits, while
the rank goes on with its recovery.
"""

from __future__ import annotations

import json
import threading
import time

from elastic_zero.checkpoint import safetensors_format
from elastic_zero.checkpoint.export import MODEL_TENSORS_FILE, MODEL_TENSORS_KEY
from elastic_zero.checkpoint.manifest import datafile_from_dict, datafile_to_dict
from elastic_zero.checkpoint.sample_runs import encode_runs
from elastic_zero.checkpoint.store import commit, free_step_dir, make_manifest, open_store, write_rank_file
from elastic_zero.zero.shard import ShardState

# how often a rank waiting for its peers' parts (or rank 0's directory) looks for them, one store exchange
# a look: soon at first, then less and less often, at most as often as the store's waits used to ask
POSTS_FIRST_LOOK_S, POSTS_LOOK_MAX_S = 0.005, 0.1


class SaveAbandoned(Exception):
    """The generation of this save failed before every rank posted its part."""


class AsyncCheckpointWriter:
    def __init__(self, uri: str, store, keep: int, stage: int, timeout_s: float = 300.0, on_commit=None) -> None:
        """`on_commit(directory)`: called on the writing thread as soon as this rank commits a save."""
        self.fs, self.root = open_store(uri)
        self.store, self.keep, self.stage, self.timeout_s = store, keep, stage, timeout_s
        self._on_commit = on_commit
        self._thread: threading.Thread | None = None
        self._abandoned = threading.Event()  # of the save in flight; each save has its own
        self._lock = threading.Lock()
        self._errors: list[str] = []
        self._committed: list[str] = []  # directories this rank committed (rank 0 only), not yet taken

    def save(self, snapshot: ShardState, tag: str, extra: dict, sample_log: list | None = None,
             model_tensors: dict | None = None, copied=None) -> float:
        """Start saving `snapshot` (a copy no one else mutates); returns the seconds spent waiting
        for the previous save. `tag` names this save uniquely across the job (generation and step);
        `sample_log` rows (what this rank trained in this generation, and earlier ones not yet
        reported) go into the manifest, as runs (sample_runs.py);
        `model_tensors` (rank 0, with the final weights: buffers and frozen parameters, host copies)
        go into a safetensors file beside the shards. `copied`: a CUDA event the snapshot's copy
        off the device completes at, which the writing thread waits for (the step does not)."""
        started = time.perf_counter()
        self.wait()
        stall = time.perf_counter() - started
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._write, daemon=True, name=f"checkpoint-{tag}",
                                        args=(snapshot, tag, extra, list(sample_log or ()), self._abandoned,
                                              model_tensors, copied))
        self._thread.start()
        return stall

    def busy(self) -> bool:
        """Whether a save is still being written (a save started now would wait for it)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abandon(self) -> None:
        """The generation failed: the save in flight will not commit. Returns at once; a rank file
        being written is finished (or fails) in the background, in a directory nothing names."""
        self._abandoned.set()

    def take_errors(self) -> list[str]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def take_committed(self) -> list[str]:
        with self._lock:
            committed, self._committed = self._committed, []
        return committed

    def _write(self, snapshot: ShardState, tag: str, extra: dict, sample_log: list, abandoned,
               model_tensors: dict | None, copied=None) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            step, rank = int(snapshot.scalars["step"]), snapshot.rank
            if rank == 0:
                directory = free_step_dir(self.fs, self.root, step)
                self.store.set(f"ckpt/{tag}/dir", directory)
            else:
                directory = self._wait_for([f"ckpt/{tag}/dir"], abandoned)[0].decode()
            entry = write_rank_file(self.fs, directory, snapshot, tag=tag)
            self.store.set(f"ckpt/{tag}/{rank}", json.dumps({"file": datafile_to_dict(entry),
                                                             "sample_runs": encode_runs(sample_log)}))
            if rank != 0:
                return
            if model_tensors:
                safetensors_format.write_all(self.fs, f"{directory}/{MODEL_TENSORS_FILE}", model_tensors)
                extra = {**extra, MODEL_TENSORS_KEY: MODEL_TENSORS_FILE}
            keys = [f"ckpt/{tag}/{r}" for r in range(snapshot.partition.world_size)]
            posted = [json.loads(v) for v in self._wait_for(keys, abandoned)]
            files = [datafile_from_dict(p["file"]) for p in posted]
            runs = sorted(tuple(run) for p in posted for run in p["sample_runs"])  # each rank's own
            manifest = make_manifest(snapshot, files, self.stage, {**extra, "sample_runs": runs})
            if abandoned.is_set():
                raise SaveAbandoned("the generation failed before the commit")
            done = commit(self.fs, self.root, manifest, self.keep, directory)
            with self._lock:
                self._committed.append(done)
            if self._on_commit is not None:
                self._on_commit(done)
        except SaveAbandoned as exc:
            self._error(tag, f"not committed: {exc}")
        except Exception as exc:  # a failed save must not stop training: reported, and the previous checkpoint stands
            self._error(tag, f"{type(exc).__name__}: {exc}")

    def _wait_for(self, keys: list[str], abandoned) -> list[bytes]:
        """The values of `keys` once all are set, looked for at growing intervals (POSTS_*); an
        abandon ends the wait at once. Not the store's own wait with a timeout: torch's client logs
        two warning lines for each wait that times out, which a rank slower to post its part made
        hundreds of. At 1,024 ranks, those waiting for rank 0's directory ask the store at most ten
        times a second each, as the waits did (a check and a wait every 0.2 s)."""
        deadline = time.monotonic() + self.timeout_s
        look_s = POSTS_FIRST_LOOK_S
        while not self.store.check(keys):
            if abandoned.wait(look_s):
                raise SaveAbandoned("the generation failed before every rank posted its part")
            if time.monotonic() > deadline:
                raise SaveAbandoned(f"not every rank posted its part within {self.timeout_s:.0f} s")
            look_s = min(2 * look_s, POSTS_LOOK_MAX_S)
        return [self.store.get(k) for k in keys]

    def _error(self, tag: str, message: str) -> None:
        with self._lock:
            self._errors.append(f"{tag}: {message}")
