"""A worker's Python warnings reach the job's user, not only the worker's stderr.

Anything on a worker that calls `warnings.warn` (the restore path passing over a damaged checkpoint,
torch, the user's own model or loss) is shown as usual and also told to the coordinator, which
makes it a `warning` event (a line in the driver's output) and an entry in `summary.warnings`.
Warning filters still apply: a warning the process ignores is not told. Each distinct text is told
once per worker (the coordinator keeps one per job)."""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Callable


def warning_text(message, category: type) -> str:
    text = str(message)
    return text if category is UserWarning else f"{category.__name__}: {text}"


def relay_warnings(tell: Callable[[str], None]) -> None:
    """From now on, every warning this process shows also goes to `tell(text)`, once per distinct text."""
    shown = warnings.showwarning
    told: set[str] = set()
    lock = threading.Lock()

    def show(message, category, filename, lineno, file=None, line=None):
        shown(message, category, filename, lineno, file, line)
        text = warning_text(message, category)
        with lock:
            if text in told:
                return
            told.add(text)
        try:
            tell(text)
        except Exception as exc:  # noqa: BLE001 - the coordinator unreachable: the warning is on stderr above
            print(f"elastic_zero: could not tell the coordinator of a warning ({exc})", file=sys.stderr)

    warnings.showwarning = show
