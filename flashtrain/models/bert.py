"""BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019) encoders on flashtrain's attention, single device.

Post-LN blocks, exact (erf) GELU, learned absolute positions, as Hugging Face's BertModel / RobertaModel. The two
flavors differ only in the embeddings: BERT's position of token t is t; RoBERTa's positions count the non-pad tokens
from pad_token_id + 1 on (pad tokens sit at position pad_token_id), as fairseq and HF's
create_position_ids_from_input_ids, so its longest sequence is max_position_embeddings - pad_token_id - 1.

Padding is removed, not masked. From attention_mask (B, T) the model takes the flat indices of the real tokens and
cu_seqlens (B + 1,) int32, runs every layer on the packed (total_tokens, hidden) tensor and attends through
flash_attn_varlen_func, so no work is spent on pad tokens; outputs are put back into (B, T, ...) only where they are
needed (the masked-LM head runs on the masked tokens only, classification reads the first token of each row).
Where attention runs PyTorch's SDPA (attn_impl sdpa, or auto without the kernel) the layers run padded, on (B, T) with
a key-padding mask (flashtrain.models.attention.runs_packed decides). Finding the real tokens of a CUDA mask costs one
host sync; an `Unpadding` (flashtrain.models.padding) built from the host batch and passed in costs none.

Parameter names are our own (a fused q|k|v projection: one GEMM instead of three); flashtrain.models.hf_convert
converts from and to the HF names, and the heads keep HF's layout (BERT's pooler + classifier,
RoBERTa's classification head on <s>, the MLM decoder tied to the word embeddings).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import (BidirectionalSelfAttention, ExactAttention, check_attn_impl, check_backend,
                                         runs_packed)
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.padding import Unpadding, check_values, pad_packed
from flashtrain.models.position import extended_table
from flashtrain.models.tying import tie_weights

FLAVORS = ("bert", "roberta")
PROBLEM_TYPES = ("single_label", "multi_label")
HEADS = ("masked_lm", "classification")
# the data each head trains on (flashtrain.data.spec.DataSpec.task)
HEAD_TASKS = {"masked_lm": "masked_lm", "classification": "document_classification"}


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
    attn_impl: str = "flash"  # flash | sdpa | reference | auto (flashtrain.models.attention); sdpa runs padded
    head: str = "classification"  # what the trainer builds: "masked_lm" (BertForMaskedLM) | "classification"
    # Longest input in tokens, specials included; when set it decides the table: max_position_embeddings becomes
    # max_length + position_offset (RoBERTa: + 2). None: max_position_embeddings as given.
    max_length: Optional[int] = None

    def __post_init__(self):
        if self.max_length is not None:
            if self.max_length < 1:
                raise ValueError(f"max_length must be >= 1 (or None), got {self.max_length}")
            self.max_position_embeddings = self.max_length + self.position_offset
        check_attn_impl(self.attn_impl)
        for name, value, allowed in (("flavor", self.flavor, FLAVORS), ("problem_type", self.problem_type, PROBLEM_TYPES), ("head", self.head, HEADS)):
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

    def build(self) -> nn.Module:
        """The model this config describes: BertForMaskedLM or BertForSequenceClassification, by `head`."""
        return BertForMaskedLM(self) if self.head == "masked_lm" else BertForSequenceClassification(self)

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        return check_backend(self.attn_impl, device, dtype, self.hidden_size // self.num_attention_heads)

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.task.DataSpec) is not what this model reads; a field
        that is None (a preview, before the data is prepared) is not checked."""
        if data.task != HEAD_TASKS[self.head]:
            raise ValueError(f"model.head={self.head} trains on {HEAD_TASKS[self.head]} data; the data is {data.task}")
        if self.head == "classification" and data.num_classes is not None and (self.num_labels, self.problem_type) != (data.num_classes,
                                                                                     data.problem_type):
            raise ValueError(f"model.num_labels={self.num_labels}, model.problem_type={self.problem_type!r} differ "
                             f"from the data's {data.num_classes}, {data.problem_type!r}")
        if self.vocab_size < data.vocab_size:
            raise ValueError(f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary "
                             f"({data.vocab_size})")
        if self.pad_token_id != data.pad_id:
            raise ValueError(f"model.pad_token_id={self.pad_token_id} differs from the tokenizer's pad id {data.pad_id}")
        if data.max_length is not None and data.max_length > self.max_seqlen:
            raise ValueError(f"{data.length_field}={data.max_length} exceeds the model's longest input, "
                             f"{self.max_seqlen} tokens (model.max_length / max_position_embeddings)")


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
        self.attn = BidirectionalSelfAttention(config.hidden_size, config.num_attention_heads,
                                               ExactAttention(config.attn_impl), config.attention_probs_dropout_prob)
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

    def extend_positions(self, new_max: int, method: str = "repeat") -> None:
        """Grow the position table to new_max positions by `method` (repeat | interpolate: flashtrain.models.position;
        RoBERTa's first two rows, which are not positions, copied) and set config.max_position_embeddings; a new
        nn.Parameter: build the optimizer after this."""
        offset = self.config.position_offset
        self.embeddings.position_embeddings = extended_table(self.embeddings.position_embeddings, new_max, method,
                                                             offset)
        self.config.max_position_embeddings = offset + new_max

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
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        if not runs_packed(self.config.attn_impl, self.embeddings.word_embeddings.weight, head_dim):
            key_padding_mask = attention_mask.bool()  # (B, T): every layer runs on all B * T tokens
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

# ---- heads -------------------------------------------------------------------------------------------------------


class MaskedLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder (its weight: the word embeddings, tied by BertForMaskedLM), plus a
    bias."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        with torch.no_grad():
            _init_weights(self.dense)
            nn.init.zeros_(self.decoder.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))  # (..., C) -> (..., vocab_size)


class BertForMaskedLM(nn.Module):
    # the repeated unit: FSDP shards each EncoderLayer on its own; trainer.activation_checkpointing recomputes per layer
    _no_split_modules = ["EncoderLayer"]

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.encoder = BertModel(config, add_pooler=False)
        self.lm_head = MaskedLMHead(config)
        # one tensor, saved as the word embeddings
        tie_weights(self, "lm_head.decoder.weight", "encoder.embeddings.word_embeddings.weight")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # each tensor once: the tied decoder is not counted twice

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens (default max_position_embeddings; flashtrain.models.flops). The
        head's decoder runs on the masked tokens only (~15%): it is left out, with the embedding tables it shares."""
        return _encoder_flops(self, self.encoder.embeddings, seq_len)

    def load_pretrained(self, init_from: str, position_extension: str = "repeat") -> str:
        """init_from=hf:NAME_OR_DIR (flashtrain.train.model_init): a Hugging Face BERT/RoBERTa checkpoint's encoder
        and, for this masked-LM model, its masked-LM head (a fresh one when it has none; a classifier's head always
        starts fresh), positions extended when the run's model.max_length is longer. Returns the note the run
        prints."""
        from flashtrain.models.pretrained_weights import load_bert_weights

        return load_bert_weights(self, self.config, init_from, position_extension, BertModel, BertForMaskedLM)

    def extend_positions(self, new_max: int, method: str = "repeat") -> None:
        """The encoder's position table grown to new_max positions (BertModel.extend_positions)."""
        self.encoder.extend_positions(new_max, method)

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


def _encoder_flops(model: nn.Module, embeddings: Embeddings, seq_len: int | None) -> float:
    c = model.config
    tables = [embeddings.word_embeddings, embeddings.position_embeddings, embeddings.token_type_embeddings]
    return training_flops_per_token(model, tables, c.num_hidden_layers, c.hidden_size,
                                    seq_len or c.max_position_embeddings)


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

    _no_split_modules = ["EncoderLayer"]  # as BertForMaskedLM's

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

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens (default max_position_embeddings; flashtrain.models.flops)."""
        return _encoder_flops(self, self.encoder.embeddings, seq_len)

    # as the masked-LM model's: the encoder (and BERT's pooler) from a Hugging Face checkpoint, a fresh classifier
    load_pretrained = BertForMaskedLM.load_pretrained
    extend_positions = BertForMaskedLM.extend_positions

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
