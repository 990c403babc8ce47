"""flashtrain: Transformer training built on its own FlashAttention kernels."""

__version__ = "0.1.0"
