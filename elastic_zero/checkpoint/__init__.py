"""Layout-independent sharded checkpoints through pyarrow.fs."""

from elastic_zero.checkpoint.interop import export_state_dict, shards_from_state_dict
from elastic_zero.checkpoint.store import (
    ChecksumError, commit, list_checkpoints, load_latest, load_shard, make_manifest, open_store, read_manifest,
    resolve, save, write_rank_file,
)

__all__ = [
    "ChecksumError", "commit", "export_state_dict", "list_checkpoints", "load_latest", "load_shard",
    "make_manifest", "open_store", "read_manifest", "resolve", "save", "shards_from_state_dict", "write_rank_file",
]
