"""Training data: batches addressed by a global sample position (see source.py)."""

__all__ = ["ArrowRows", "BlockShuffledOrder", "DataError", "MarkovTokens"]

# Each name is imported on first use: a driver that only checks a dataset's size needs neither torch
# (order, synthetic) nor pyarrow.dataset and the pandas it loads (arrow_rows), each a second of a
# process's start on two cores.
_HOMES = {"ArrowRows": "arrow_rows", "DataError": "arrow_rows", "BlockShuffledOrder": "order",
          "MarkovTokens": "synthetic"}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"elastic_zero.data.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'elastic_zero.data' has no attribute {name!r}")
