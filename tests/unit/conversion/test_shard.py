"""Pure TP split/merge round-trips with fake ranks (no Megatron, no process group)."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.conversion.shard import (
    gated_merge,
    gated_shard,
    pad_vocab,
    qkv_fuse,
    qkv_merge,
    qkv_shard,
    qkv_split,
    tp_merge,
    tp_shard,
    unpad_vocab,
)

GEN = torch.Generator().manual_seed(0)


def _rand(*shape):
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("nh,g", [(4, 1), (4, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_round_trip(nh, g, tp, bias):
    hd, h = 8, 16
    tail = () if bias else (h,)
    q, k, v = _rand(nh * hd, *tail), _rand(g * hd, *tail), _rand(g * hd, *tail)
    shards = [qkv_shard(q, k, v, nh, g, tp, r) for r in range(tp)]
    assert all(s.shape[0] == (nh + 2 * g) * hd // tp for s in shards)
    for got, want in zip(qkv_merge(shards, nh, g, hd), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_qkv_grouped_layout_matches_megatron_definition():
    """Megatron views the fused output as [G, (NH/G + 2)·hd] and splits [NH/G·hd, hd, hd]."""
    nh, g, hd = 4, 2, 3
    q = torch.arange(nh * hd).float()
    k = 100 + torch.arange(g * hd).float()
    v = 200 + torch.arange(g * hd).float()
    fused = qkv_fuse(q, k, v, nh, g).view(g, -1)
    for grp in range(g):
        assert torch.equal(fused[grp, : 2 * hd], q.view(g, -1)[grp])
        assert torch.equal(fused[grp, 2 * hd: 3 * hd], k.view(g, hd)[grp])
        assert torch.equal(fused[grp, 3 * hd:], v.view(g, hd)[grp])


def test_qkv_tp_greater_than_groups_is_contiguous_chunks():
    """t > G: ranks hold contiguous row chunks of the grouped tensor (part of one group each)."""
    nh, g, hd, tp = 4, 1, 2, 4
    q, k, v = _rand(nh * hd, 5), _rand(g * hd, 5), _rand(g * hd, 5)
    fused = qkv_fuse(q, k, v, nh, g)
    shards = [qkv_shard(q, k, v, nh, g, tp, r) for r in range(tp)]
    assert torch.equal(torch.cat(shards), fused)
    assert all(torch.equal(a, b) for a, b in zip(qkv_merge(shards, nh, g, hd), (q, k, v), strict=True))


def test_qkv_shape_errors_name_the_constraint():
    with pytest.raises(ValueError, match="num_query_groups"):
        qkv_fuse(_rand(12, 4), _rand(4, 4), _rand(4, 4), 3, 2)
    with pytest.raises(ValueError, match="expected"):
        qkv_split(_rand(10, 4), 4, 2, 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4"):
        tp_shard(_rand(6, 4), 0, 4, 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_mlp_round_trip_and_rank_layout(tp):
    f, h = 8, 6
    gate, up = _rand(f, h), _rand(f, h)
    shards = [gated_shard(gate, up, tp, r) for r in range(tp)]
    # rank r holds [gate.chunk(t)[r]; up.chunk(t)[r]], not cat([gate, up]).chunk(t)[r]
    assert torch.equal(shards[-1][: f // tp], gate.chunk(tp)[-1])
    assert torch.equal(shards[-1][f // tp:], up.chunk(tp)[-1])
    g2, u2 = gated_merge(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_column_replicated_round_trip(dim, tp):
    full = _rand(8, 12)
    parts = [tp_shard(full, dim, tp, r) for r in range(tp)]
    assert torch.equal(tp_merge(parts, dim), full)


@pytest.mark.parametrize("v,tp", [(301, 1), (301, 2), (301, 4), (384, 4)])
def test_vocab_padding(v, tp):
    from megatron_maspo.model.spec import tiny_qwen2_spec

    vp = tiny_qwen2_spec(vocab_size=v).padded_vocab_size(tp, 128)
    emb = _rand(v, 4)
    padded = pad_vocab(emb, vp)
    assert padded.shape == (vp, 4) and vp % (128 * tp) == 0
    assert torch.equal(padded[v:], torch.zeros(vp - v, 4))
    shards = [tp_shard(padded, 0, tp, r) for r in range(tp)]
    assert torch.equal(unpad_vocab(tp_merge(shards, 0), v), emb)
    with pytest.raises(ValueError, match="vocab_size"):
        unpad_vocab(emb[:10], v)
