"""Training data: batches addressed by a global sample position (see source.py)."""

from elastic_zero.data.arrow_rows import ArrowRows, DataError
from elastic_zero.data.order import BlockShuffledOrder
from elastic_zero.data.synthetic import MarkovTokens

__all__ = ["ArrowRows", "BlockShuffledOrder", "DataError", "MarkovTokens"]
