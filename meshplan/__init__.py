"""meshplan: a distributed-training compiler for PyTorch models."""

__version__ = "0.1.0"
