"""Training data: deterministic sample streams addressed by a global sample index."""

from elastic_zero.data.synthetic import MarkovTokens

__all__ = ["MarkovTokens"]
