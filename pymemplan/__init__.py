"""pymemplan: make PyTorch training fit in GPU memory, and waste none of it."""

__version__ = "0.1.0"
