"""Models that exist only for the tests: a one-block causal Transformer LM, registered from outside the package.

It shows what a new model needs: this file (the model, its config with build / attention_backend / check_data, the
schema registered with Hydra, and, for a model with a transformers counterpart, its Hugging Face adapter) and one YAML
file (tests/conf/model/toy.yaml). `test_toy_model.py` trains it through launch.py (FLASHTRAIN_PLUGINS=toy_model, on
PYTHONPATH; hydra.searchpath=[file://tests/conf] model=toy) and exports the run with python -m flashtrain.export as a
transformers GPT-2 of one layer with exact GELU.

ToyLM defines none of the optional methods of the model protocol, and gets the defaults: no generate(), so an LM run
ends with "sample skipped: ToyLM defines no generate()"; no load_pretrained(), so init_from takes hf:DIR through its
Hugging Face adapter and a flashtrain checkpoint of its own shapes; no extend_positions(), so a source with fewer
positions stops with an error naming that method. LongToyLM (model.extendable=true) defines extend_positions(new_max,
method) and load_pretrained(init_from, position_extension): it starts from a toy run with a shorter position table.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from torch import Tensor

from flashtrain.models.attention import attention, check_attn_impl, check_backend
from flashtrain.models.hf_convert import HFAdapter, register_hf_adapter
from flashtrain.models.position import extended_table
from flashtrain.models.tying import tie_weights
from flashtrain.train.model_init import checkpoint_weights, load_hf_weights


@dataclass
class ToyConfig:
    vocab_size: int = 512  # tokens in the vocabulary
    n_positions: int = 128  # longest sequence; rows of the learned position table
    d_model: int = 64  # width
    n_head: int = 2  # attention heads; head_dim = d_model // n_head
    attn_impl: str = "flash"  # flash | sdpa | reference | auto (flashtrain.models.attention)
    extendable: bool = False  # build LongToyLM, the toy with load_pretrained() and extend_positions()

    def __post_init__(self):
        check_attn_impl(self.attn_impl)

    def build(self) -> "ToyLM":
        return LongToyLM(self) if self.extendable else ToyLM(self)

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        return check_backend(self.attn_impl, device, dtype, self.d_model // self.n_head)

    def check_data(self, data) -> None:
        if data.task != "causal_lm":
            raise ValueError(f"the toy model trains on causal_lm data; the data is {data.task}")
        if self.vocab_size < data.vocab_size:
            raise ValueError(f"model.vocab_size={self.vocab_size} is smaller than the data's {data.vocab_size}")
        if data.max_length is not None and data.max_length > self.n_positions:
            raise ValueError(f"{data.length_field}={data.max_length} exceeds model.n_positions={self.n_positions}")


class ToyLM(nn.Module):
    """Embeddings, one pre-LN causal attention block with an MLP, a tied LM head."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        C = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb = nn.Embedding(config.n_positions, C)
        self.attn_norm, self.mlp_norm, self.final_norm = nn.LayerNorm(C), nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.head = nn.Linear(C, config.vocab_size, bias=False)
        tie_weights(self, "head.weight", "tok_emb.weight")  # one tensor, saved as tok_emb
        nn.init.normal_(self.tok_emb.weight, std=0.02)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids (B, T) -> (logits (B, T, vocab_size), mean cross-entropy against targets (B, T) or None)."""
        B, T = input_ids.shape
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(T, device=input_ids.device))  # (B, T, C)
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.config.n_head, -1).unbind(dim=2)  # (B, T, H, D)
        x = x + self.out(attention(q, k, v, self.config.attn_impl, causal=True).reshape(B, T, -1))
        x = x + self.mlp(self.mlp_norm(x))
        logits = self.head(self.final_norm(x))  # (B, T, vocab_size)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


class LongToyLM(ToyLM):
    """ToyLM with the two optional methods a model defines to start from other weights: a longer position table
    (init_position_extension) and its own loader for init_from."""

    def extend_positions(self, new_max: int, method: str = "repeat") -> None:
        """Grow pos_emb to new_max rows (repeat | interpolate: flashtrain.models.position) and config.n_positions."""
        self.pos_emb = extended_table(self.pos_emb, new_max, method)
        self.config.n_positions = new_max

    def load_pretrained(self, init_from: str, position_extension: str = "repeat") -> str:
        """hf:DIR through the adapter (flashtrain.train.model_init.load_hf_weights, which calls extend_positions), or
        a toy checkpoint / run directory (its newest checkpoint) of up to config.n_positions positions, extended."""
        if init_from.startswith("hf:"):
            return load_hf_weights(self, init_from, position_extension)
        ckpt, state = checkpoint_weights(init_from)
        n_source, n_model = state["pos_emb.weight"].shape[0], self.config.n_positions
        if n_source > n_model:
            raise ValueError(f"init_from={init_from!r} has {n_source} positions, more than model.n_positions={n_model}")
        source = LongToyLM(replace(self.config, n_positions=n_source))
        source.load_state_dict(state)
        note = f"initialised from {ckpt}"
        if n_source < n_model:
            source.extend_positions(n_model, position_extension)
            note += f", positions extended {n_source} -> {n_model} ({position_extension})"
        self.load_state_dict(source.state_dict())
        return note


ConfigStore.instance().store(group="model", name="toy_schema", node=ToyConfig)


# ---- Hugging Face: a transformers GPT-2 of one layer, exact GELU ---------------------------------------------------

# our module -> HF GPT-2's; HF's projections are Conv1D, weight (in, out), ours nn.Linear, weight (out, in)
_HF_NAMES = {"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "attn_norm": "transformer.h.0.ln_1",
             "qkv": "transformer.h.0.attn.c_attn", "out": "transformer.h.0.attn.c_proj",
             "mlp_norm": "transformer.h.0.ln_2", "mlp.0": "transformer.h.0.mlp.c_fc",
             "mlp.2": "transformer.h.0.mlp.c_proj", "final_norm": "transformer.ln_f", "head": "lm_head"}
_CONV1D = {"qkv", "out", "mlp.0", "mlp.2"}


def _rename(state_dict: dict, names: dict, conv1d: set) -> dict:
    """Keys renamed by module; a key of another module keeps its name (a strict load then rejects it)."""
    converted = {}
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".")
        name = f"{names[module]}.{kind}" if module in names else key
        converted[name] = value.t() if module in conv1d and kind == "weight" else value
    return converted


def toy_to_hf(state_dict: dict, config: ToyConfig) -> dict:
    # our state dict keeps the tied head once, as tok_emb; HF's lm_head.weight is the same tensor
    return {**_rename(state_dict, _HF_NAMES, _CONV1D), "lm_head.weight": state_dict["tok_emb.weight"]}


def toy_from_hf(state_dict: dict, config: ToyConfig) -> dict:
    return _rename(state_dict, {hf: ours for ours, hf in _HF_NAMES.items()}, {_HF_NAMES[name] for name in _CONV1D})


def toy_config_to_hf(config: ToyConfig, tokenizer):
    import transformers

    return transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.d_model,
                                   n_layer=1, n_head=config.n_head, activation_function="gelu", resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                                   eos_token_id=tokenizer.eos_token_id)


def toy_config_from_hf(hf_config, attn_impl: str = "flash") -> ToyConfig:
    return ToyConfig(vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions, d_model=hf_config.n_embd,
                     n_head=hf_config.n_head, attn_impl=attn_impl)


register_hf_adapter(ToyLM, HFAdapter("AutoModelForCausalLM", toy_config_from_hf, toy_config_to_hf, toy_from_hf,
                                     toy_to_hf, max_length=lambda config: config.n_positions))
