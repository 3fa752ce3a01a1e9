"""What the coordinator reads of the job's checkpoint store (no torch: the catalog only): the
commits a recovery may restore, and the job's own commits that no note told of."""

from __future__ import annotations


def checkpoint_candidates(uri: str) -> tuple[tuple[str, ...], list[tuple[str, list]]]:
    """What a checkpoint generation may restore: the committed checkpoints under `uri`, newest commit
    first, and each one's sample records (directory, rows). A ValueError when there is none."""
    from elastic_zero.checkpoint import open_store, read_manifest, restore_candidates
    from elastic_zero.checkpoint.sample_runs import manifest_rows

    fs, root = open_store(uri)
    candidates = tuple(restore_candidates(fs, root))
    if not candidates:
        raise ValueError(f"{root}: no committed checkpoint")
    return candidates, [(d, manifest_rows(read_manifest(fs, d).extra)) for d in candidates]


def commits_since(uri: str, started_at: float, log) -> list[str]:
    """The checkpoints committed under `uri` since `started_at` (epoch seconds); none, with a warning
    written by `log`, where the store cannot be read now (the recovery's own read will say so)."""
    from elastic_zero.checkpoint import committed_since, open_store

    try:
        fs, root = open_store(uri)
        return list(committed_since(fs, root, started_at))
    except ValueError as exc:
        log("warning", message=f"could not look for the job's checkpoints: {exc}")
        return []
