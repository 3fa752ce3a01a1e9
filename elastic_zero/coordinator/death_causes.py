"""Why a worker's process ended, read from the error Ray gives its callers: a kill by Ray's memory
monitor is told as that, with the node's figures, not as a plain loss. Pure: text in, text out."""

from __future__ import annotations

import re

# Ray's raylet writes both into the actor's death cause when its memory monitor kills a worker
_KILLED_FOR_MEMORY = "killed due to the node running low on memory"
MEMORY_KILL = "killed by Ray's memory monitor"
_NODE_FIGURES = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [^)]*\) was ([\d.]+)GB used / ([\d.]+)GB limit")


def memory_kill(error: str) -> str | None:
    """A line saying Ray's memory monitor killed the worker, with the node's memory then, or None."""
    if _KILLED_FOR_MEMORY not in error:
        return None
    figures = _NODE_FIGURES.search(error)
    if figures is None:
        return f"{MEMORY_KILL} (the node ran low on memory)"
    ip, used, limit = figures.groups()
    return f"{MEMORY_KILL}: node {ip} had {float(used):.2f} GB in use of its {float(limit):.2f} GB limit"


def is_memory_kill(told: str | None) -> bool:
    """Whether a loss's error (as memory_kill() told it) was Ray's memory monitor."""
    return bool(told) and told.startswith(MEMORY_KILL)
