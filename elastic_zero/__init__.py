"""elastic_zero: elastic ZeRO training for PyTorch on Ray."""

__version__ = "0.1.0"
