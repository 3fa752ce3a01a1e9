"""Layout-independent sharded checkpoints through pyarrow.fs.

The names below load their module when first used: `catalog` (opening a store, listing and resolving
its commits, probing it) needs no torch, and the driver and the coordinator use it before any worker
has started; the rest (reading and writing shards, weights in and out) imports torch.
"""

import importlib

_MODULE_OF = {
    **dict.fromkeys(("export_state_dict", "load_initial_weights", "load_into", "shards_from_state_dict"), "interop"),
    **dict.fromkeys(("RestoreError", "restore_shard"), "restore"),
    **dict.fromkeys(("StoreError", "committed_since", "list_checkpoints", "open_store", "probe_writable",
                     "read_manifest", "resolve", "restore_candidates"), "catalog"),
    **dict.fromkeys(("ChecksumError", "commit", "load_latest", "load_shard", "make_manifest", "save",
                     "write_rank_file"), "store"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_zero.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"elastic_zero.checkpoint.{module}"), name)
    globals()[name] = value
    return value
