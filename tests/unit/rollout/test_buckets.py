"""Bucket packing: round trip (dtypes, offsets, alignment), exact fit, tensors split across buckets and
reassembled (the 7B embedding at the default bucket size), checksums, wire form."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.rollout.buckets import (
    ALIGN,
    bucket_from_wire,
    bucket_to_wire,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
    unpack_stream,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(7, 5, generator=g)), ("b.bias", torch.randn(3, generator=g).bfloat16()),
            ("c.idx", torch.arange(11, dtype=torch.int64)), ("d.flag", torch.tensor([True, False, True])),
            ("e.weight", torch.randn(4, 4, generator=g).half())]


def test_round_trip_across_buckets_is_bitwise():
    src = _tensors()
    buckets = list(pack_buckets(iter(src), bucket_bytes=160))
    assert len(buckets) > 1 and [b.index for b in buckets] == list(range(len(buckets)))
    got = [item for b in buckets for item in unpack_bucket(b)]
    assert [n for n, _ in got] == [n for n, _ in src]
    for (_, want), (_, have) in zip(src, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
    for b in buckets:
        assert b.buffer.numel() <= 160 and all(m.offset % ALIGN == 0 for m in b.metas)


def test_exact_fit_and_a_tensor_one_byte_over_is_split_not_rejected():
    t = torch.arange(32, dtype=torch.float32)  # 128 bytes
    (only,) = pack_buckets([("x", t)], bucket_bytes=128)
    assert only.buffer.numel() == 128 and only.metas[0].part is None
    split = list(pack_buckets([("x", t)], bucket_bytes=127))
    assert [m.part for b in split for m in b.metas] == [(0, 127), (127, 1)]
    ((name, got),) = list(unpack_stream(split))
    assert name == "x" and torch.equal(got, t)


def test_dtype_cast_duplicate_names_and_bad_size():
    (b,) = pack_buckets([("w", torch.ones(4)), ("i", torch.ones(2, dtype=torch.int32))], 1 << 10,
                        dtype=torch.bfloat16)
    assert [m.dtype for m in b.metas] == ["bfloat16", "int32"]  # integers are never cast
    with pytest.raises(ValueError, match="appears twice"):
        list(pack_buckets([("w", torch.ones(1)), ("w", torch.ones(1))], 1 << 10))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack_buckets([("w", torch.ones(1))], 0))


def test_checksum_detects_a_single_flipped_bit_and_wire_round_trip():
    (b,) = pack_buckets(_tensors(), 1 << 12)
    wire = bucket_from_wire(bucket_to_wire(b))
    assert torch.equal(wire.buffer, b.buffer) and wire.metas == b.metas and wire.checksum == b.checksum
    unpack_bucket(wire)
    wire.buffer[100] ^= 0x01
    with pytest.raises(ValueError, match="bucket 0 is corrupted"):
        unpack_bucket(wire)
    unpack_bucket(wire, verify=False)  # verification is what caught it


SEVEN_B_EMBEDDING = (152064, 3584)  # Qwen2.5-7B / R1-Distill-7B vocab x hidden, bf16: 1,040 MiB


def test_the_7b_embedding_plans_at_the_default_bucket_size():
    """Today's code rejected any tensor above 512 MiB; the default bucket now carries it in 3 pieces."""
    from megatron_maspo.rollout.config import RolloutConfig
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb

    cap = bucket_bytes_from_mb(RolloutConfig().bucket_mb)
    entries = [("model.embed_tokens.weight", "bfloat16", SEVEN_B_EMBEDDING), ("model.norm.weight", "bfloat16",
               (3584,))]
    plan = list(plan_buckets(entries, cap))
    pieces = [m for ms in plan for m in ms if m.name == "model.embed_tokens.weight"]
    assert sum(m.span for m in pieces) == 152064 * 3584 * 2 and len(pieces) == 3
    assert [m.part[0] for m in pieces] == [0, cap, 2 * cap] and pieces[-1].completes
    assert all(sum(m.span for m in ms) <= cap for ms in plan)
    assert plan[-1][-1].name == "model.norm.weight"  # the small tensor shares the last piece's bucket


def test_plan_matches_pack_for_mixed_sizes():
    g = torch.Generator().manual_seed(1)
    src = [("a", torch.randn(10, generator=g)), ("big", torch.randn(300, generator=g)),
           ("c", torch.randn(3, generator=g).bfloat16()), ("huge", torch.randn(1000, generator=g))]
    packed = [b.metas for b in pack_buckets(src, 512)]
    planned = list(plan_buckets([(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in src], 512))
    assert packed == planned
    got = dict(unpack_stream(pack_buckets(src, 512)))
    assert all(torch.equal(got[n], t) for n, t in src)


def test_5_mib_tensor_through_1_mib_buckets_is_bitwise_over_the_wire_and_into_the_engine():
    """A real split sync, scaled down (1 MiB buckets, a 5 MiB + 3 B tensor): the wire form keeps the pieces,
    the built-in engine's ``load_buckets`` reassembles them bitwise."""
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine

    cfg = {"model_type": "qwen2", "vocab_size": 5 * 2**18 // 16 + 1, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "max_position_embeddings": 32, "tie_word_embeddings": True}
    engine = BuiltinEngine.from_hf_config(cfg, device="cpu")
    g = torch.Generator().manual_seed(2)
    src = [(n, torch.randn(p.shape, generator=g)) for n, p in engine.model.named_parameters()]
    emb = dict(src)["model.embed_tokens.weight"]
    assert emb.numel() * 4 > 5 * 2**20
    buckets = [bucket_from_wire(bucket_to_wire(b)) for b in pack_buckets(iter(src), 2**20)]
    assert sum(m.name == "model.embed_tokens.weight" for b in buckets for m in b.metas) == 6
    engine.load_buckets(iter(buckets))
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n].view(torch.uint8), t.view(torch.uint8)) for n, t in src)
    with pytest.raises(ValueError, match="incomplete"):  # a piece missing at the end of the sync
        engine.load_buckets(iter(buckets[:1]))
    with pytest.raises(ValueError, match="Reassembler"):
        unpack_bucket(buckets[0])


def test_pieces_out_of_order_raise():
    buckets = list(pack_buckets([("x", torch.arange(100.0))], 128))
    with pytest.raises(ValueError, match="out of order"):
        list(unpack_stream([buckets[0], buckets[2]]))


@pytest.mark.slow
def test_a_real_7b_embedding_crosses_default_buckets_bitwise():
    """The 1,040 MiB bf16 embedding itself through pack -> wire-less unpack at the default bucket size
    (about 2.5 GiB peak: the tensor, one 512 MiB bucket, the reassembled copy)."""
    import zlib

    from megatron_maspo.rollout.config import RolloutConfig
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb

    emb = torch.empty(SEVEN_B_EMBEDDING, dtype=torch.bfloat16)
    emb.view(torch.int16).copy_(torch.arange(emb.numel(), dtype=torch.int32).view(SEVEN_B_EMBEDDING)
                                .remainder(65521).to(torch.int16))
    want = zlib.crc32(emb.view(-1).view(torch.uint8).numpy())
    cap = bucket_bytes_from_mb(RolloutConfig().bucket_mb)
    n_buckets = 0

    def counted(bs):
        nonlocal n_buckets
        for b in bs:
            n_buckets += 1
            yield b

    ((name, got),) = list(unpack_stream(counted(pack_buckets([("model.embed_tokens.weight", emb)], cap))))
    assert name == "model.embed_tokens.weight" and n_buckets == 3 and got.shape == SEVEN_B_EMBEDDING
    assert zlib.crc32(got.reshape(-1).view(torch.uint8).numpy()) == want
