"""Training data: deterministic sample streams addressed by a global sample position."""

from elastic_zero.data.order import GlobalOrder
from elastic_zero.data.synthetic import MarkovTokens

__all__ = ["GlobalOrder", "MarkovTokens"]
