"""Bucket packing: round trip (dtypes, offsets, alignment), exact-fit and oversized tensors, checksums, wire form."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.rollout.buckets import (
    ALIGN,
    bucket_from_wire,
    bucket_to_wire,
    pack_buckets,
    unpack_bucket,
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


def test_exact_fit_and_oversized_tensor():
    t = torch.zeros(32)  # 128 bytes
    (only,) = pack_buckets([("x", t)], bucket_bytes=128)
    assert only.buffer.numel() == 128
    with pytest.raises(ValueError, match=r"tensor 'x' .* 128 bytes > bucket size 127"):
        list(pack_buckets([("x", t)], bucket_bytes=127))


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


@pytest.mark.parametrize("rows", [1, 257, 273])  # 1.0 MiB + 1 KiB or 64 KiB: a one-decimal hint rounds down
def test_bucket_size_hint_names_a_size_that_works(rows):
    import re

    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb

    t = torch.zeros(1024 + rows, 256)  # fp32: (1024 + rows) KiB
    with pytest.raises(ValueError, match=r"set rollout.bucket_mb=(\d+) or more") as e:
        list(pack_buckets([("big.weight", t)], bucket_bytes=bucket_bytes_from_mb(1)))
    hinted = int(re.search(r"bucket_mb=(\d+)", str(e.value)).group(1))
    (b,) = pack_buckets([("big.weight", t)], bucket_bytes=bucket_bytes_from_mb(hinted))
    assert b.metas[0].name == "big.weight"
