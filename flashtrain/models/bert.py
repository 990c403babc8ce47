"""BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019) encoders on flashtrain's attention, single device.

Post-LN blocks, exact (erf) GELU, learned absolute positions, as Hugging Face's BertModel / RobertaModel. The two
flavors differ only in the embeddings: BERT's position of token t is t; RoBERTa's positions count the non-pad tokens
from pad_token_id + 1 on (pad tokens sit at position pad_token_id), as fairseq and HF's
create_position_ids_from_input_ids, so its longest sequence is max_position_embeddings - pad_token_id - 1.

Padding is removed, not masked. From attention_mask (B, T) the model takes the flat indices of the real tokens and
cu_seqlens (B + 1,) int32, runs every layer on the packed (total_tokens, hidden) tensor and attends through
flash_attn_varlen_func, so no work is spent on pad tokens; outputs are put back into (B, T, ...) only where they are
needed (the masked-LM head runs on the masked tokens only, classification reads the first token of each row).
Finding the real tokens of a CUDA mask costs one host sync (their number sizes the packed tensor); an `Unpadding`
built from the host batch (Unpadding.of on CPU tensors, then .to(device)) and passed in costs none.
attn_impl="sdpa" is the padded baseline: PyTorch's scaled_dot_product_attention on (B, T) with a key-padding mask.

Parameter names are our own (a fused q|k|v projection: one GEMM instead of three); load_hf_state_dict and
to_hf_state_dict convert from and to the HF names, and the heads keep HF's layout (BERT's pooler + classifier,
RoBERTa's classification head on <s>, the MLM decoder tied to the word embeddings).
"""

import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import BidirectionalSelfAttention

FLAVORS = ("bert", "roberta")
ATTN_IMPLS = ("flash", "sdpa", "reference")
PROBLEM_TYPES = ("single_label", "multi_label")
HEADS = ("masked_lm", "classification")
_HF_PROBLEM_TYPES = {None: "single_label", "single_label_classification": "single_label",
                     "multi_label_classification": "multi_label"}
# Non-persistent buffers that old HF checkpoints still carry (e.g. MiniLM, saved by transformers 4.8).
_HF_LEGACY_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


@dataclass
class BertConfig:
    flavor: str = "bert"  # "bert" (positions 0, 1, ...) | "roberta" (from pad_token_id + 1; pads at pad_token_id)
    vocab_size: int = 30522  # tokens in the vocabulary (BERT uncased WordPiece; RoBERTa: 50265)
    hidden_size: int = 768  # model width
    num_hidden_layers: int = 12  # encoder layers
    num_attention_heads: int = 12  # attention heads; head_dim = hidden_size // num_attention_heads
    intermediate_size: int = 3072  # width of the MLP
    max_position_embeddings: int = 512  # rows of the position table (RoBERTa: 514 for 512 tokens)
    type_vocab_size: int = 2  # token types (segments A/B); RoBERTa: 1
    pad_token_id: int = 0  # padding token; RoBERTa: 1, also its position index for pads
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and on each residual branch
    attention_probs_dropout_prob: float = 0.1  # dropout on attention probabilities, training only
    classifier_dropout: Optional[float] = None  # dropout in the classification head; None: hidden_dropout_prob
    num_labels: int = 2  # classes (single_label) or independent labels (multi_label)
    problem_type: str = "single_label"  # "single_label" (softmax cross-entropy) | "multi_label" (BCE with logits)
    attn_impl: str = "flash"  # "flash" (flashtrain kernel, "auto" dispatch) | "sdpa" (PyTorch, padded) | "reference"
    head: str = "classification"  # what the trainer builds: "masked_lm" (BertForMaskedLM) | "classification"
    # Longest input in tokens, specials included; when set it decides the table: max_position_embeddings becomes
    # max_length + position_offset (RoBERTa: + 2). None: max_position_embeddings as given.
    max_length: Optional[int] = None

    def __post_init__(self):
        if self.max_length is not None:
            if self.max_length < 1:
                raise ValueError(f"max_length must be >= 1 (or None), got {self.max_length}")
            self.max_position_embeddings = self.max_length + self.position_offset
        for name, value, allowed in (("flavor", self.flavor, FLAVORS), ("attn_impl", self.attn_impl, ATTN_IMPLS),
                                     ("problem_type", self.problem_type, PROBLEM_TYPES), ("head", self.head, HEADS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        sizes = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                     num_attention_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
                     type_vocab_size=self.type_vocab_size, num_labels=self.num_labels)
        for name, size in sizes.items():
            if size <= 0:
                raise ValueError(f"{name} must be positive, got {size}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads})")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be in [0, vocab_size={self.vocab_size}), got {self.pad_token_id}")
        if self.max_position_embeddings <= self.position_offset:
            raise ValueError(f"max_position_embeddings must exceed {self.position_offset} (flavor {self.flavor!r}), "
                             f"got {self.max_position_embeddings}")
        dropouts = dict(hidden_dropout_prob=self.hidden_dropout_prob,
                        attention_probs_dropout_prob=self.attention_probs_dropout_prob,
                        classifier_dropout=self.classifier_dropout)
        for name, p in dropouts.items():
            if p is not None and not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if self.problem_type == "single_label" and self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2 for problem_type 'single_label', got {self.num_labels}")

    @property
    def position_offset(self) -> int:
        """Position index of the first token: 0 for BERT, pad_token_id + 1 for RoBERTa."""
        return 0 if self.flavor == "bert" else self.pad_token_id + 1

    @property
    def max_seqlen(self) -> int:
        """Longest input in tokens, padding included."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf_config, attn_impl: str = "flash") -> "BertConfig":
        """Build from a transformers BertConfig or RobertaConfig; raises ValueError for options this model lacks."""
        if hf_config.model_type not in FLAVORS:
            raise ValueError(f"hf_config.model_type must be one of {FLAVORS}, got {hf_config.model_type!r}")
        if hf_config.hidden_act != "gelu":
            raise ValueError(f"hf_config.hidden_act must be 'gelu', got {hf_config.hidden_act!r}")
        if hf_config.is_decoder or hf_config.add_cross_attention:
            raise ValueError("hf_config.is_decoder and add_cross_attention must be False: this is an encoder")
        if not hf_config.tie_word_embeddings:
            raise ValueError("hf_config.tie_word_embeddings must be True: the masked-LM decoder is the word embeddings")
        if hf_config.problem_type not in _HF_PROBLEM_TYPES or (hf_config.problem_type is None
                                                               and hf_config.num_labels == 1):
            raise ValueError(f"hf_config.problem_type {hf_config.problem_type!r} (num_labels={hf_config.num_labels}) "
                             "is not supported: single- or multi-label classification only, no regression")
        return cls(flavor=hf_config.model_type, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                   num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=hf_config.num_attention_heads,
                   intermediate_size=hf_config.intermediate_size,
                   max_position_embeddings=hf_config.max_position_embeddings,
                   type_vocab_size=hf_config.type_vocab_size, pad_token_id=hf_config.pad_token_id,
                   layer_norm_eps=hf_config.layer_norm_eps, hidden_dropout_prob=hf_config.hidden_dropout_prob,
                   attention_probs_dropout_prob=hf_config.attention_probs_dropout_prob,
                   classifier_dropout=hf_config.classifier_dropout, num_labels=hf_config.num_labels,
                   problem_type=_HF_PROBLEM_TYPES[hf_config.problem_type], attn_impl=attn_impl)


# ---- unpadding ---------------------------------------------------------------------------------------------------


class Unpadding(NamedTuple):
    """Where the real tokens of a right-padded (B, T) batch are: what the model needs to run on them packed."""

    indices: Tensor  # (total,) int64: positions of the real tokens in the flattened (B * T) batch, row-major
    cu_seqlens: Tensor  # (B + 1,) int32: sequence b is packed rows cu_seqlens[b]:cu_seqlens[b + 1]
    max_seqlen: int  # T, a bound on every length (it only sizes the kernels' grid; the true maximum needs a sync)
    masked_rows: Tensor | None = None  # masked-LM: (n_masked,) int64 packed rows whose label is not -100

    @classmethod
    def of(cls, attention_mask: Tensor, labels: Tensor | None = None) -> "Unpadding":
        """attention_mask (B, T), nonzero at real tokens; labels (B, T) (masked LM) or None. No host sync on CPU
        tensors (the loader's batch); on CUDA tensors torch.nonzero syncs (the number of tokens is data)."""
        is_real = attention_mask.bool()
        seqlens = is_real.sum(dim=1, dtype=torch.int32)  # (B,)
        indices = torch.nonzero(is_real.flatten()).flatten()  # (total,)
        cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))  # (B + 1,)
        masked_rows = None
        if labels is not None:
            masked_rows = torch.nonzero(labels.flatten()[indices] != -100).flatten()  # (n_masked,)
        return cls(indices, cu_seqlens, attention_mask.shape[1], masked_rows)

    def to(self, device: torch.device | str) -> "Unpadding":
        """The same on `device`, copied without waiting (the host batch's tensors stay alive until the copy ran)."""
        moved = [None if x is None else x.to(device, non_blocking=True)
                 for x in (self.indices, self.cu_seqlens, self.masked_rows)]
        return Unpadding(moved[0], moved[1], self.max_seqlen, moved[2])


def unpad_indices(attention_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """attention_mask (B, T), nonzero at real tokens -> (indices, cu_seqlens, max_seqlen) of Unpadding.of."""
    return Unpadding.of(attention_mask)[:3]


def check_values(valid: Tensor, message: str) -> None:
    """Raise ValueError(message) unless the bool scalar `valid` is True: at once on the CPU; on a GPU as a device
    assert (torch._assert_async) that stops the program at the next synchronisation, so a training step never waits
    on the check."""
    if valid.device.type == "cpu":
        if not bool(valid):
            raise ValueError(message)
    else:
        torch._assert_async(valid, message)


def pad_packed(packed: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """packed (total, ...) -> (batch, seqlen, ...) with zeros at pad positions; inverse of x.flatten(0, 1)[indices]."""
    padded = packed.new_zeros(batch * seqlen, *packed.shape[1:]).index_copy(0, indices, packed)
    return padded.view(batch, seqlen, *packed.shape[1:])


# ---- encoder -----------------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        position_padding_idx = config.pad_token_id if config.flavor == "roberta" else None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=position_padding_idx)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """Three id tensors of one shape (...) -> (..., hidden_size)."""
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x + self.position_embeddings(position_ids)))


class EncoderLayer(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x)), dropout at the end of each branch."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = BidirectionalSelfAttention(config.hidden_size, config.num_attention_heads, config.attn_impl,
                                               config.attention_probs_dropout_prob)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.mlp_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, key_padding_mask: Tensor | None) -> Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x, cu_seqlens, max_seqlen, key_padding_mask)))
        return self.mlp_norm(x + self.dropout(self.mlp_out(F.gelu(self.mlp_in(x)))))  # exact GELU = HF "gelu"


def _init_weights(module: nn.Module) -> None:
    """HF BERT init: normal(0, 0.02) weights, zero biases and padding rows; LayerNorm already starts at 1, 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        nn.init.zeros_(module.weight[module.padding_idx])


class BertModel(nn.Module):
    """Embeddings + encoder layers (+ BERT's pooler: dense + tanh on the first token), as HF BertModel/RobertaModel."""

    def __init__(self, config: BertConfig, add_pooler: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooler else None
        with torch.no_grad():
            self.apply(_init_weights)

    def position_ids(self, input_ids: Tensor) -> Tensor:
        """(B, T) -> (B, T). RoBERTa: pad_token_id + number of non-pad tokens so far, pad_token_id at pads."""
        if self.config.flavor == "bert":
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        is_token = input_ids.ne(self.config.pad_token_id).long()
        return torch.cumsum(is_token, dim=1) * is_token + self.config.pad_token_id

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
               unpadding: Unpadding | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids (B, T); attention_mask (B, T), 1 at real tokens, 0 at pads, None for no padding; token_type_ids
        (B, T) or None (all 0); unpadding: Unpadding.of(attention_mask) when the caller has it (built on the host:
        no host sync here), else computed here. -> (hidden (total, C) at the real tokens in row-major order, indices
        (total,) of those tokens in the flattened (B * T) batch, cu_seqlens (B + 1,) int32). Row cu_seqlens[b] is
        sequence b's first token ([CLS] / <s>): the first token of every row must be real.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.config.max_seqlen:
            raise ValueError(f"input_ids has {T} tokens, more than the {self.config.max_seqlen} that "
                             f"max_position_embeddings={self.config.max_position_embeddings} allows")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        for name, ids in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if ids.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(ids.shape)} must equal input_ids shape {(B, T)}")
        check_values(attention_mask[:, 0].bool().all(), "attention_mask[:, 0] must be 1 in every row: each sequence "
                     "starts with its first real token ([CLS] / <s>); pad on the right")
        position_ids = self.position_ids(input_ids)  # (B, T)
        if unpadding is None:
            unpadding = Unpadding.of(attention_mask)
        indices, cu_seqlens, max_seqlen = unpadding[:3]
        if self.config.attn_impl == "sdpa":  # padded baseline: every layer runs on all B * T tokens
            key_padding_mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
            x = self.embeddings(input_ids, position_ids, token_type_ids)  # (B, T, C)
            for layer in self.layers:
                x = layer(x, None, T, key_padding_mask)
            return x.flatten(0, 1)[indices], indices, cu_seqlens
        packed_ids = (ids.flatten()[indices] for ids in (input_ids, position_ids, token_type_ids))  # each (total,)
        x = self.embeddings(*packed_ids)  # (total, C)
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen, None)
        return x, indices, cu_seqlens

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                unpadding: Unpadding | None = None) -> tuple[Tensor, Tensor | None]:
        """-> (last hidden states (B, T, C), zeros at pads; pooled output (B, C) or None without a pooler)."""
        hidden, indices, cu_seqlens = self.encode(input_ids, attention_mask, token_type_ids, unpadding)
        pooled = None
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(hidden[cu_seqlens[:-1].long()]))  # (B, C)
        return pad_packed(hidden, indices, *input_ids.shape), pooled

    # ---- Hugging Face conversion -------------------------------------------------------------------------------

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load an HF BertModel / RobertaModel state dict (keys with or without the "bert." / "roberta." prefix),
        strictly; the pooler weights must be there exactly when this model has a pooler."""
        prefix = self.config.flavor + "."
        state_dict = {key.removeprefix(prefix): value for key, value in state_dict.items()}
        self.load_state_dict(_encoder_from_hf(state_dict, prefix=""), strict=True)

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """State dict that transformers' BertModel / RobertaModel (add_pooling_layer = this model has a pooler)
        loads with strict=True."""
        return _encoder_to_hf(self.state_dict(), prefix="")

    @classmethod
    def from_pretrained_hf(cls, hf_model, attn_impl: str = "flash") -> "BertModel":
        """Copy of a transformers BertModel / RobertaModel: its config, weights, dtype and device."""
        model = cls(BertConfig.from_hf(hf_model.config, attn_impl=attn_impl), add_pooler=hf_model.pooler is not None)
        model.to(device=hf_model.device, dtype=hf_model.dtype)
        model.load_hf_state_dict(hf_model.state_dict())
        return model


# ---- heads -------------------------------------------------------------------------------------------------------


class MaskedLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder, whose weight is the word embeddings, plus a bias."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        with torch.no_grad():
            _init_weights(self.dense)
            nn.init.zeros_(self.decoder.bias)
        self.decoder.weight = word_embeddings.weight  # tied: one tensor, two names in the state dict

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))  # (..., C) -> (..., vocab_size)


class BertForMaskedLM(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.encoder = BertModel(config, add_pooler=False)
        self.lm_head = MaskedLMHead(config, self.encoder.embeddings.word_embeddings)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # each tensor once: the tied decoder is not counted twice

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                labels: Tensor | None = None, unpadding: Unpadding | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids, attention_mask, token_type_ids, unpadding as in BertModel.encode; labels (B, T): the original
        token at masked positions, -100 elsewhere (pads included). With labels, an unpadding from
        Unpadding.of(attention_mask, labels) (masked_rows set) spares the host sync of finding the masked tokens.

        Without labels -> (logits (B, T, vocab_size), zeros at pads; None). With labels the head runs on the masked
        tokens only -> (logits (n_masked, vocab_size), equal to full_logits[labels != -100] in that row-major order;
        mean cross-entropy over the masked tokens, in float32).
        """
        hidden, indices, _ = self.encoder.encode(input_ids, attention_mask, token_type_ids, unpadding)  # (total, C)
        if labels is None:
            return pad_packed(self.lm_head(hidden), indices, *input_ids.shape), None
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            check_values((labels.eq(-100) | attention_mask.bool()).all(),
                         "labels must be -100 at pad positions (attention_mask 0)")
        packed_labels = labels.flatten()[indices]  # (total,)
        masked_rows = unpadding.masked_rows if unpadding is not None else None
        if masked_rows is None:
            masked_rows = torch.nonzero(packed_labels != -100).flatten()  # (n_masked,)
        logits = self.lm_head(hidden[masked_rows])  # (n_masked, vocab_size)
        return logits, F.cross_entropy(logits.float(), packed_labels[masked_rows])

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load an HF BertForMaskedLM / RobertaForMaskedLM state dict, strictly."""
        self.load_state_dict(_masked_lm_from_hf(state_dict, self.config.flavor), strict=True)

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """State dict that transformers' BertForMaskedLM / RobertaForMaskedLM loads with strict=True."""
        return _masked_lm_to_hf(self.state_dict(), self.config.flavor)

    @classmethod
    def from_pretrained_hf(cls, hf_model, attn_impl: str = "flash") -> "BertForMaskedLM":
        """Copy of a transformers BertForMaskedLM / RobertaForMaskedLM: its config, weights, dtype and device."""
        model = cls(BertConfig.from_hf(hf_model.config, attn_impl=attn_impl))
        model.to(device=hf_model.device, dtype=hf_model.dtype)
        model.load_hf_state_dict(hf_model.state_dict())
        return model


class RobertaClassificationHead(nn.Module):
    """On <s>: dropout, dense + tanh, dropout, out_proj (HF RobertaClassificationHead)."""

    def __init__(self, config: BertConfig, dropout: float):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.dropout = nn.Dropout(dropout)

    def forward(self, first_token: Tensor) -> Tensor:
        x = self.dropout(torch.tanh(self.dense(self.dropout(first_token))))  # (B, C)
        return self.out_proj(x)  # (B, num_labels)


class BertForSequenceClassification(nn.Module):
    """BERT: pooler (dense + tanh on [CLS]), dropout, classifier. RoBERTa: RobertaClassificationHead on <s>."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        is_bert = config.flavor == "bert"
        self.encoder = BertModel(config, add_pooler=is_bert)
        dropout = config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout
        if is_bert:
            self.dropout = nn.Dropout(dropout)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        else:
            self.classifier = RobertaClassificationHead(config, dropout)
        with torch.no_grad():
            self.classifier.apply(_init_weights)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                labels: Tensor | None = None, unpadding: Unpadding | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids, attention_mask, token_type_ids, unpadding as in BertModel.encode -> (logits (B, num_labels),
        loss).

        labels: single_label (B,) class indices -> mean cross-entropy; multi_label (B, num_labels) of 0/1 -> mean
        binary cross-entropy with logits over all B * num_labels entries. Loss in float32; None without labels.
        """
        hidden, _, cu_seqlens = self.encoder.encode(input_ids, attention_mask, token_type_ids, unpadding)
        first_token = hidden[cu_seqlens[:-1].long()]  # (B, C): [CLS] / <s>
        if self.config.flavor == "bert":
            logits = self.classifier(self.dropout(torch.tanh(self.encoder.pooler(first_token))))
        else:
            logits = self.classifier(first_token)  # (B, num_labels)
        if labels is None:
            return logits, None
        B = input_ids.shape[0]
        if self.config.problem_type == "single_label":
            if labels.shape != (B,):
                raise ValueError(f"labels must be ({B},) class indices for single_label, got {tuple(labels.shape)}")
            return logits, F.cross_entropy(logits.float(), labels)
        if labels.shape != logits.shape:
            raise ValueError(f"labels must be {tuple(logits.shape)} for multi_label, got {tuple(labels.shape)}")
        return logits, F.binary_cross_entropy_with_logits(logits.float(), labels.float())

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load an HF BertForSequenceClassification / RobertaForSequenceClassification state dict, strictly."""
        self.load_state_dict(_encoder_from_hf(state_dict, prefix=self.config.flavor + "."), strict=True)

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """State dict that transformers' BertForSequenceClassification / RobertaForSequenceClassification loads with
        strict=True. The head keeps HF's names (classifier.*)."""
        return _encoder_to_hf(self.state_dict(), prefix=self.config.flavor + ".")

    @classmethod
    def from_pretrained_hf(cls, hf_model, attn_impl: str = "flash") -> "BertForSequenceClassification":
        """Copy of a transformers Bert/RobertaForSequenceClassification: its config, weights, dtype and device.
        To start from an encoder-only checkpoint, load it with the HF class (from_pretrained initialises the head)."""
        model = cls(BertConfig.from_hf(hf_model.config, attn_impl=attn_impl))
        model.to(device=hf_model.device, dtype=hf_model.dtype)
        model.load_hf_state_dict(hf_model.state_dict())
        return model


# ---- HF key conversion -------------------------------------------------------------------------------------------
# (HF name, our name) prefixes inside the encoder; {i} is a layer index. HF's separate query, key and value
# projections are concatenated into our layers.{i}.attn.qkv.

_ENCODER_RENAMES = [
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("encoder.layer.{i}.attention.output.dense.", "layers.{i}.attn.out."),
    ("encoder.layer.{i}.attention.output.LayerNorm.", "layers.{i}.attn_norm."),
    ("encoder.layer.{i}.intermediate.dense.", "layers.{i}.mlp_in."),
    ("encoder.layer.{i}.output.dense.", "layers.{i}.mlp_out."),
    ("encoder.layer.{i}.output.LayerNorm.", "layers.{i}.mlp_norm."),
    ("pooler.dense.", "pooler."),
]
_HF_QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)")
_OUR_QKV = re.compile(r"layers\.(\d+)\.attn\.qkv\.(weight|bias)")


def _rename(key: str, source_index: int) -> str:
    """Rename by _ENCODER_RENAMES, from HF (source_index 0) or from ours (1); keys not listed keep their name."""
    for names in _ENCODER_RENAMES:
        pattern = re.escape(names[source_index]).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.match(pattern, key)
        if match:
            target = names[1 - source_index].replace("{i}", match.groupdict().get("i") or "")
            return target + key[match.end():]
    return key


def _encoder_from_hf(state_dict: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """HF encoder keys under `prefix` ("bert." / "roberta.") -> ours under "encoder."; with prefix "" every key is an
    encoder key and ours have no prefix. Keys outside the prefix (heads) pass through unchanged."""
    our_prefix = "encoder." if prefix else ""
    converted, qkv_parts = {}, {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            converted[key] = value
            continue
        key = key.removeprefix(prefix)
        if key in _HF_LEGACY_BUFFERS:
            continue
        match = _HF_QKV.fullmatch(key)
        if match:
            layer, projection, kind = match.groups()
            qkv_parts.setdefault((layer, kind), {})[projection] = value
        else:
            converted[our_prefix + _rename(key, source_index=0)] = value
    for (layer, kind), parts in qkv_parts.items():
        if parts.keys() != {"query", "key", "value"}:
            raise ValueError(f"state_dict has {sorted(parts)} but not all of query, key, value "
                             f"for layer {layer} {kind}")
        converted[f"{our_prefix}layers.{layer}.attn.qkv.{kind}"] = torch.cat(
            [parts["query"], parts["key"], parts["value"]])
    return converted


def _encoder_to_hf(state_dict: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Inverse of _encoder_from_hf: our keys under "encoder." (all keys when prefix is "") -> HF's under prefix."""
    our_prefix = "encoder." if prefix else ""
    converted = {}
    for key, value in state_dict.items():
        if not key.startswith(our_prefix):
            converted[key] = value
            continue
        key = key.removeprefix(our_prefix)
        match = _OUR_QKV.fullmatch(key)
        if match:
            layer, kind = match.groups()
            for projection, part in zip(("query", "key", "value"), value.chunk(3)):
                converted[f"{prefix}encoder.layer.{layer}.attention.self.{projection}.{kind}"] = part
        else:
            converted[prefix + _rename(key, source_index=1)] = value
    return converted


# Masked-LM head: (BERT name, RoBERTa name, ours). HF ties decoder.weight to the word embeddings and
# decoder.bias to the head's bias; both appear in its state dict.
_MLM_HEAD_RENAMES = [
    ("cls.predictions.transform.dense.", "lm_head.dense.", "lm_head.dense."),
    ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm.", "lm_head.norm."),
    ("cls.predictions.bias", "lm_head.bias", "lm_head.decoder.bias"),
]
_MLM_TIED = {"bert": ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"),
             "roberta": ("lm_head.decoder.weight", "lm_head.decoder.bias")}


def _masked_lm_from_hf(state_dict: dict[str, Tensor], flavor: str) -> dict[str, Tensor]:
    column = FLAVORS.index(flavor)
    decoder_weight_key, decoder_bias_key = _MLM_TIED[flavor]
    state_dict = dict(state_dict)
    decoder_weight, decoder_bias = state_dict.pop(decoder_weight_key, None), state_dict.pop(decoder_bias_key, None)
    converted = {}
    for key, value in _encoder_from_hf(state_dict, prefix=flavor + ".").items():
        for names in _MLM_HEAD_RENAMES:
            if key.startswith(names[column]):
                key = names[2] + key[len(names[column]):]
                break
        converted[key] = value
    word_embeddings = converted["lm_head.decoder.weight"] = converted["encoder.embeddings.word_embeddings.weight"]
    if decoder_weight is not None and not torch.equal(decoder_weight, word_embeddings):
        raise ValueError(f"state_dict has {decoder_weight_key} different from the word embeddings; "
                         "this model ties them")
    if decoder_bias is not None and not torch.equal(decoder_bias, converted.setdefault("lm_head.decoder.bias",
                                                                                      decoder_bias)):
        raise ValueError(f"state_dict has {decoder_bias_key} different from {_MLM_HEAD_RENAMES[2][column]}; "
                         "HF ties them")
    return converted


def _masked_lm_to_hf(state_dict: dict[str, Tensor], flavor: str) -> dict[str, Tensor]:
    column = FLAVORS.index(flavor)
    decoder_weight_key, decoder_bias_key = _MLM_TIED[flavor]
    state_dict = dict(state_dict)
    decoder_weight = state_dict.pop("lm_head.decoder.weight")  # the word embeddings
    converted = {}
    for key, value in _encoder_to_hf(state_dict, prefix=flavor + ".").items():
        for names in _MLM_HEAD_RENAMES:
            if key.startswith(names[2]):
                key = names[column] + key[len(names[2]):]
                break
        converted[key] = value
    converted[decoder_weight_key] = decoder_weight
    converted[decoder_bias_key] = state_dict["lm_head.decoder.bias"]
    return converted
