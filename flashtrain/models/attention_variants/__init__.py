"""Attention variants of the LRA encoder, one file each; the model config's `attention` holds the chosen variant's
config, which builds the inner attention module of every layer (flashtrain/models/attention.py: `AttentionConfig`,
one call signature for every inner module). From the command line: `model/attention=NAME` (a file of
conf/model/attention/), its options `model.attention.KEY=VALUE`.

    dense         exact softmax attention, flashtrain's kernel (model.attn_impl)             flashtrain.models.attention
    longformer    window + global blocks, block-sparse on flashtrain's kernel                 block_sparse.py
    bigbird       window + global + random blocks, block-sparse on flashtrain's kernel        block_sparse.py
    butterfly     flat block butterfly + global blocks, block-sparse on flashtrain's kernel   block_sparse.py
    linformer     keys and values projected to k rows along the sequence (k = 256 or N / 8)   linformer.py
    performer     FAVOR+: positive orthogonal random features, linear in N                    performer.py
    local         sliding window of exact attention at token granularity                      local.py
    lsh           Reformer's LSH attention: shared QK, hashing rounds, sorted chunks          lsh.py

Dense and block-sparse attention run on packed inputs (padding removed) when the backend takes them; the others run
padded, with a key-padding mask. A new variant is a new file here with its config (a dataclass subclass of
AttentionConfig with a `name`), a line in VARIANTS below, and a YAML file in conf/model/attention/.
"""

from flashtrain.models.attention import AttentionConfig, DenseAttentionConfig
from flashtrain.models.attention_variants.block_sparse import BlockSparseConfig
from flashtrain.models.attention_variants.linformer import LinformerConfig
from flashtrain.models.attention_variants.local import LocalAttentionConfig
from flashtrain.models.attention_variants.lsh import LSHAttentionConfig
from flashtrain.models.attention_variants.performer import PerformerConfig

# schema name -> config class; Hydra stores each as model/attention/<name>_schema
VARIANTS: dict[str, type[AttentionConfig]] = {cls.name: cls for cls in (
    DenseAttentionConfig, BlockSparseConfig, LinformerConfig, PerformerConfig, LocalAttentionConfig,
    LSHAttentionConfig)}

__all__ = ["VARIANTS", "AttentionConfig", "BlockSparseConfig", "DenseAttentionConfig", "LSHAttentionConfig",
           "LinformerConfig", "LocalAttentionConfig", "PerformerConfig"]
