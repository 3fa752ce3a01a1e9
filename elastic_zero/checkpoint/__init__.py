"""Layout-independent sharded checkpoints through pyarrow.fs."""

from elastic_zero.checkpoint.interop import export_state_dict, load_initial_weights, load_into, shards_from_state_dict
from elastic_zero.checkpoint.restore import RestoreError, restore_shard
from elastic_zero.checkpoint.store import (
    ChecksumError, StoreError, commit, list_checkpoints, load_latest, load_shard, make_manifest, open_store,
    probe_writable, read_manifest, resolve, restore_candidates, save, write_rank_file,
)

__all__ = [
    "ChecksumError", "commit", "export_state_dict", "load_initial_weights", "load_into", "list_checkpoints", "load_latest", "load_shard",
    "make_manifest", "open_store", "probe_writable", "read_manifest", "resolve", "RestoreError", "restore_candidates",
    "restore_shard", "save", "shards_from_state_dict", "StoreError", "write_rank_file",
]
