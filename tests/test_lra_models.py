"""LRA model options: the dual-tower Retrieval head, block-sparse attention, 2D position upsampling and init_from
from a smaller image grid (flashtrain/models/lra.py, position.py, train/model_init.py)."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashtrain.models.attention_variants import BlockSparseConfig
from flashtrain.models.lra import LRAClassifier, LRAConfig
from flashtrain.models.position import upsample_positions_2d
from flashtrain.train.checkpoint import write_manifest
from flashtrain.train.model_init import load_initial_weights


def local_global(seqlen: int, local_blocks: int, global_blocks: int) -> torch.Tensor:
    """The "local_global" layout: |i - j| <= local_blocks, or i < global_blocks, or j < global_blocks."""
    return BlockSparseConfig("local_global", local_blocks, global_blocks).block_mask(seqlen)


def tiny(**change) -> LRAClassifier:
    torch.manual_seed(0)
    fields = dict(vocab_size=256, max_len=400, n_layer=2, n_head=2, d_model=16, d_ff=24, dropout=0.0,
                  attn_dropout=0.0, positions="learned", pooling="cls", num_classes=2, pad_id=0, attn_impl="flash")
    return LRAClassifier(LRAConfig(**{**fields, **change})).eval()


def test_dual_head_reads_both_documents():
    model = tiny(dual=True)
    g = torch.Generator().manual_seed(0)
    docs = torch.randint(1, 256, (3, 2, 20), generator=g)  # (B, 2, L)
    docs[0, 0, 15:] = 0  # padding inside each half
    docs[1, 1, 3:] = 0
    tokens = docs.flatten(1)  # (B, 2 L) = [doc 1 | doc 2]
    logits = model(tokens)[0]
    with torch.no_grad():  # the same numbers from the encoder and head by hand
        e1, e2 = model.encode(docs[:, 0]), model.encode(docs[:, 1])
        expected = model.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-6)
    swapped = model(docs.flip(1).flatten(1))[0]  # e1 - e2 changes sign: the head is not symmetric
    assert (swapped - logits).abs().max() > 1e-3
    assert [m.out_features for m in model.head if isinstance(m, torch.nn.Linear)] == [24, 12, 2]
    assert model.head[0].in_features == 4 * 16
    with pytest.raises(ValueError, match="dual"):
        model(tokens[:, :-1])  # an odd row cannot be two equal halves


@pytest.mark.parametrize("change", [dict(), dict(pooling="mean"), dict(dual=True)])
def test_unpadding_built_on_the_host_gives_the_same_logits(change):
    """model.unpadding(tokens) (built from the host batch so that a GPU step needs no host sync) passed to forward
    gives bitwise the logits the model computes finding the pads itself; with the CLS token counted and, dual, the
    two documents of a row packed as two sequences."""
    model = tiny(**change)
    tokens = torch.randint(1, 256, (3, 40), generator=torch.Generator().manual_seed(2))
    if change.get("dual"):  # each half of 20 right-padded; packed: the first documents, then the second ones
        tokens[0, 13:20], tokens[1, 31:], tokens[2, 5:20] = 0, 0, 0
        lengths = [13, 20, 5, 20, 11, 20]
    else:
        tokens[0, 13:], tokens[1, 31:], tokens[2, 5:] = 0, 0, 0
        lengths = [13, 31, 5]
    unpadding = model.unpadding(tokens)
    lengths = [n + (model.cls is not None) for n in lengths]
    assert unpadding.cu_seqlens.diff().tolist() == lengths
    with torch.no_grad():
        assert torch.equal(model(tokens, unpadding=unpadding)[0], model(tokens)[0])
    assert tiny(pad_id=None).unpadding(tokens) is None


def test_block_mask_layout():
    mask = local_global(5 * 128 + 1, local_blocks=1, global_blocks=1)  # 6 blocks
    expected = torch.tensor([[1, 1, 1, 1, 1, 1],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 0, 1, 1, 1, 0],
                             [1, 0, 0, 1, 1, 1],
                             [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(local_global(128, 0, 0), torch.ones(1, 1, dtype=torch.bool))


@pytest.mark.parametrize("pad_id", [0, None])
def test_block_sparse_attention_is_masked_dense_attention(pad_id):
    """The block-sparse model equals the dense one whose attention gets the same mask expanded to tokens (sdpa)."""
    layout = BlockSparseConfig(kind="local_global", local_blocks=0, global_blocks=1)
    sparse = tiny(attention=layout, pad_id=pad_id)
    dense = tiny(attn_impl="sdpa", pad_id=pad_id)
    dense.load_state_dict(sparse.state_dict())
    tokens = torch.randint(1, 256, (2, 383), generator=torch.Generator().manual_seed(1))  # + CLS: 384 = 3 blocks
    if pad_id is not None:
        tokens[1, 300:] = 0
    blocks = local_global(384, 0, 1)  # (3, 3): block 0 global, blocks 1 and 2 see themselves
    allowed = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)  # (384, 384) tokens

    sdpa = F.scaled_dot_product_attention

    def masked_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        keys = allowed if attn_mask is None else allowed & attn_mask  # (L, L) & (B, 1, 1, L) padding
        return sdpa(q, k, v, attn_mask=keys, dropout_p=dropout_p, is_causal=is_causal)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr("flashtrain.models.attention.F.scaled_dot_product_attention", masked_sdpa)
        expected = dense(tokens)[0]
    got = sparse(tokens)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - tiny(pad_id=pad_id)(tokens)[0]).abs().max() > 1e-4  # the mask changes the answer
    with pytest.raises(ValueError, match="block_sparse"):
        LRAConfig(attn_impl="sdpa", attention=layout)


def test_upsample_positions_2d_exact():
    table = torch.arange(1 + 2 * 3, dtype=torch.float32)[:, None] * torch.tensor([1.0, -1.0])  # (1 + 2 x 3, 2)
    up = upsample_positions_2d(table, height=2, width=3, factor=2, n_prefix=1)  # (1 + 4 x 6, 2)
    # row 0 (CLS) kept; pixel (r, c) of the 4 x 6 grid takes old pixel (r // 2, c // 2) = old row 1 + 3 (r // 2) + c // 2
    grid = [[1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 3, 3], [4, 4, 5, 5, 6, 6], [4, 4, 5, 5, 6, 6]]
    assert up[:, 0].tolist() == [0.0] + [float(v) for row in grid for v in row]
    assert torch.equal(up[:, 1], -up[:, 0])
    four = upsample_positions_2d(torch.arange(4.0)[:, None], 2, 2, factor=4)  # no prefix, 8 x 8
    assert four[:, 0].view(8, 8)[5].tolist() == [2.0] * 4 + [3.0] * 4 and four[:, 0].view(8, 8)[3, 7] == 1.0
    with pytest.raises(ValueError, match="table"):
        upsample_positions_2d(table, 2, 2, 2, n_prefix=1)


@pytest.mark.parametrize("pooling,factor", [("cls", 2), ("mean", 4)])
def test_init_from_smaller_grid_upsamples_positions(tmp_path, pooling, factor):
    n_prefix = int(pooling == "cls")
    source = tiny(pooling=pooling, max_len=n_prefix + 4 * 4, pad_id=None)  # a 4 x 4 image
    ckpt = tmp_path / "runs" / "path64" / "2026-01-01_00-00-00" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(ckpt / "model.safetensors"))
    write_manifest(ckpt, 10, config={})  # init_from verifies a checkpoint against its manifest, as resume does
    side = 4 * factor
    model = tiny(pooling=pooling, max_len=n_prefix + side * side, pad_id=None)
    # a directory of runs (runs/path64): its newest checkpoint
    note = load_initial_weights(model, model.config, str(tmp_path / "runs" / "path64"), "repeat")
    assert f"4x4 -> {side}x{side}" in note
    old = source.pos_emb.weight.detach()
    new = model.pos_emb.weight.detach()
    assert new.shape == (n_prefix + side * side, 16)
    for r, c in ((0, 0), (side - 1, side - 1), (factor, 2 * factor + 1), (side - 1, 0)):
        assert torch.equal(new[n_prefix + r * side + c], old[n_prefix + (r // factor) * 4 + c // factor])
    assert torch.equal(new[:n_prefix], old[:n_prefix])
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight, rtol=0, atol=0)
    # an image whose pixels repeat in factor x factor blocks: the upsampled model sees the source's picture
    image = torch.randint(0, 256, (2, 4, 4))
    big = image.repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    if pooling == "mean":  # mean over every pixel of blocks that all equal the source's: the same pooled vector
        for block in model.blocks + source.blocks:  # (attention mixes the same values: also the same, without it)
            block.attn.out.weight.data.zero_()
        torch.testing.assert_close(model.encode(big.flatten(1)), source.encode(image.flatten(1)), atol=1e-5,
                                   rtol=1e-5)

    with pytest.raises(ValueError, match="square"):
        load_initial_weights(tiny(pooling=pooling, max_len=n_prefix + 50, pad_id=None), None, str(ckpt), "repeat")
