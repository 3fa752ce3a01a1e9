"""Training data: batches addressed by a global sample position (see source.py)."""

from elastic_zero.data.order import BlockShuffledOrder
from elastic_zero.data.synthetic import MarkovTokens

__all__ = ["ArrowRows", "BlockShuffledOrder", "DataError", "MarkovTokens"]


def __getattr__(name: str):
    # pyarrow.dataset (and the pandas it loads) only for a job that reads a dataset: a half second
    # of every process's start otherwise (the coordinator's and each worker's)
    if name in ("ArrowRows", "DataError"):
        from elastic_zero.data import arrow_rows

        return getattr(arrow_rows, name)
    raise AttributeError(f"module 'elastic_zero.data' has no attribute {name!r}")
