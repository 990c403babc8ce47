"""Training FLOPs per token of a Transformer, PaLM's convention (Chowdhery et al. 2022, appendix B), as nanoGPT and
llm.c count them for MFU: 6 per parameter that multiplies activations (forward 2, backward 4; tables that are only
looked up are left out), plus 12 * layers * width * sequence length for softmax attention's Q K^T and P V (forward and
backward, the whole square also when causal), scaled by the fraction of the square a model computes."""
from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn


def training_flops_per_token(model: nn.Module, lookup_tables: Iterable[nn.Module | None], n_layer: int, width: int,
                             seq_len: int, attention_fraction: float = 1.0) -> float:
    """model's parameters (each tensor once) minus those of lookup_tables (embeddings used only as lookups)."""
    lookups = sum(p.numel() for table in lookup_tables if table is not None for p in table.parameters())
    matmul = sum(p.numel() for p in model.parameters()) - lookups
    return 6.0 * matmul + 12.0 * n_layer * width * seq_len * attention_fraction
