"""Longer inputs for models with learned absolute positions: grow the position table, then fine-tune.

"repeat" tiles the pretrained rows, as Longformer (Beltagy et al. 2020) initialised its 4K positions from RoBERTa's
512: position p gets pretrained row p mod n_old, so every position keeps the local structure the model learned and the
first n_old positions are unchanged -- the extended model computes exactly what it did on inputs that fit the old
table. RoBERTa's first pad_token_id + 1 = 2 rows are not positions (row 1 is the pad tokens' position); they are
copied as they are and only the rows after them are tiled (Longformer's conversion script left them uninitialised).

"interpolate" stretches the pretrained rows linearly over the new length, endpoints aligned: new position j takes the
pretrained table at the fractional position j * (n_old - 1) / (new_max - 1), i.e. (1 - f) * row[floor] + f * row[floor
+ 1]. Position 0 and the last position keep their rows exactly; all others change, so outputs on short inputs change
too (a one-token input, which only sees position 0, is the exception). For RoBERTa, again over the rows after the
first two, which are copied.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

METHODS = ("repeat", "interpolate")


def extend_position_embeddings(model: nn.Module, new_max: int, method: str = "repeat") -> None:
    """Grow model's position table in place so that it takes inputs of up to new_max tokens, and update its config.

    Calls the model's own `extend_positions(new_max, method)`, the method a model defines to have its positions
    extended (GPT2: transformer.wpe, config.n_positions = new_max; BertModel / BertForMaskedLM /
    BertForSequenceClassification: embeddings.position_embeddings, config.max_position_embeddings = new_max plus the
    offset of 2 for RoBERTa, whose positions start at pad_token_id + 1); a model without it stops with a TypeError
    naming the method. The new table is a new nn.Parameter: build the optimizer after calling this.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    extend = getattr(model, "extend_positions", None)
    if not callable(extend):
        raise TypeError(f"model {type(model).__name__} defines no extend_positions(new_max, method), the method that "
                        f"grows its position table to new_max positions ({new_max} asked; method {method!r}); "
                        f"flashtrain.models.position.extended_table builds the new table of a learned nn.Embedding")
    extend(new_max, method)


def extended_table(table: nn.Embedding, new_max: int, method: str = "repeat", offset: int = 0) -> nn.Embedding:
    """A new position table of offset + new_max rows from `table` (offset + old_max rows, old_max < new_max): its
    first `offset` rows, which are not positions (RoBERTa's 2), as they are, then its old_max position rows extended
    by `method` ("repeat" | "interpolate", as the module's docstring says). Same device, dtype, padding_idx and
    requires_grad; the model sets it in place of the old table and updates its config (`extend_positions`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    old_max = table.num_embeddings - offset
    if new_max <= old_max:
        raise ValueError(f"new_max must exceed the current maximum of {old_max} tokens, got {new_max}")
    old_weight = table.weight.detach()  # (offset + old_max, C)
    pretrained = old_weight[offset:]  # (old_max, C): the rows of real positions
    if method == "repeat":
        extended = pretrained[torch.arange(new_max, device=pretrained.device) % old_max]  # (new_max, C)
    else:  # linear, endpoints aligned; computed in float32 at least
        compute_dtype = torch.promote_types(pretrained.dtype, torch.float32)
        extended = F.interpolate(pretrained.to(compute_dtype).t()[None], size=new_max, mode="linear",
                                 align_corners=True)[0].t().to(pretrained.dtype)  # (new_max, C)
    new_weight = torch.cat([old_weight[:offset], extended])  # (offset + new_max, C)
    new_table = nn.Embedding(offset + new_max, new_weight.shape[1], padding_idx=table.padding_idx,
                             device=new_weight.device, dtype=new_weight.dtype)
    with torch.no_grad():
        new_table.weight.copy_(new_weight)
    new_table.weight.requires_grad_(table.weight.requires_grad)
    return new_table


def upsample_positions_2d(table: torch.Tensor, height: int, width: int, factor: int,
                          n_prefix: int = 0) -> torch.Tensor:
    """Learned positions of an image grid, upsampled for an image `factor` times larger on each side.

    table (n_prefix + height * width, d): n_prefix rows that are not pixels (an LRA CLS token: 1), then the grid row
    by row. Returns (n_prefix + factor**2 * height * width, d): the prefix rows as they are, then the grid of
    (factor * height) x (factor * width) in which pixel (r, c) takes the pretrained row of pixel (r // factor,
    c // factor) -- every pretrained position becomes a factor x factor block (nearest neighbour), as the FlashAttention
    paper did from Path-64 to Path-X (factor 2) and Path-256 (factor 4).
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if height < 1 or width < 1 or n_prefix < 0:
        raise ValueError(f"height and width must be >= 1 and n_prefix >= 0, got {height}, {width}, {n_prefix}")
    if table.dim() != 2 or table.shape[0] != n_prefix + height * width:
        raise ValueError(f"table must be (n_prefix + height * width = {n_prefix + height * width}, dim), "
                         f"got shape {tuple(table.shape)}")
    grid = table[n_prefix:].view(height, width, -1)  # (H, W, d)
    grid = grid.repeat_interleave(factor, dim=0).repeat_interleave(factor, dim=1)  # (k H, k W, d)
    return torch.cat([table[:n_prefix], grid.flatten(0, 1)])
