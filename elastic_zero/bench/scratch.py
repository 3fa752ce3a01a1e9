"""A bench's own working directory: the jobs' run dirs and checkpoints it measures and then has no
use for (a checkpoint bench of a real model writes gigabytes). Removed when the bench succeeds; kept
when it fails, because its errors name files in it ("see RUN_DIR")."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=prefix)
    yield path  # an exception raised in the body skips the removal below
    shutil.rmtree(path, ignore_errors=True)
