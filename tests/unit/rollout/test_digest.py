"""The weight digest (rollout/digest.py): equal to its defining sum computed independently in Python
integers, additive over pieces at any offset, sampled blocks as specified, and sensitive to one flipped
word, a stale tensor and swapped elements."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.rollout import digest as dg

FULL = dg.Spec()


def _reference(t: torch.Tensor, spec: dg.Spec = FULL) -> int:
    """The module docstring's formula, element by element in Python ints (small tensors only)."""
    w = dg.words(t).tolist()
    b = [int(v) for v in dg._block_weights(torch.device("cpu")).tolist()]
    sums: dict[int, int] = {}
    for i, x in enumerate(w):
        j = i // dg.BLOCK
        if j % spec.stride == spec.phase:
            sums[j] = sums.get(j, 0) + x * b[i % dg.BLOCK]
    ids = sorted(sums)
    a = dg._mix(torch.tensor(ids, dtype=torch.int64), 104_729, dg.P - 1).tolist() if ids else []
    return sum(ai * (sums[j] % dg.P) for ai, j in zip(a, ids)) % dg.P


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_digest_equals_its_definition(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5000, generator=g) * 40).to(dtype)  # 15000 elements: 4+ blocks, a partial tail
    assert int(dg.digest(t)) == _reference(t)
    for spec in (dg.Spec(3, 0), dg.Spec(3, 2), dg.Spec(2, 1)):
        assert int(dg.digest(t, spec)) == _reference(t, spec)


@pytest.mark.parametrize("spec", [dg.Spec(), dg.Spec(4, 1)])
def test_digest_is_the_sum_of_its_pieces(spec):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(40_000, generator=g).to(torch.bfloat16)
    whole = int(dg.digest(t, spec))
    for cuts in ([0, 40_000], [0, 1, 40_000], [0, 4096, 12_000, 12_001, 33_333, 40_000], [0, 39_999, 40_000]):
        parts = [int(dg.digest(t[a:b], spec, offset=a)) for a, b in zip(cuts, cuts[1:])]
        assert sum(parts) % dg.P == whole, cuts


def test_one_flipped_word_a_stale_tensor_and_a_swap_all_change_the_digest():
    g = torch.Generator().manual_seed(2)
    new = torch.randn(257, 33, generator=g).to(torch.bfloat16)
    old = new - 1e-2 * torch.randn(257, 33, generator=g).to(torch.bfloat16)
    d = int(dg.digest(new))
    for idx in (0, 1, 4095, 4096, 257 * 33 - 1):
        bad = new.clone().reshape(-1)
        bad.view(torch.int16)[idx] ^= 1  # the lowest mantissa bit of one element
        assert int(dg.digest(bad.view(257, 33))) != d, idx
    assert int(dg.digest(old)) != d
    swapped = new.clone().reshape(-1)
    swapped[[3, 5000]] = swapped[[5000, 3]]
    assert not torch.equal(swapped, new.reshape(-1)) and int(dg.digest(swapped)) != d
    nan = new.clone().reshape(-1)
    nan[7] = float("nan")
    assert int(dg.digest(nan)) != d


def test_plan_full_first_then_rotating_samples():
    assert dg.plan(5, 0) is None
    assert dg.plan(5, 1)(100) == dg.Spec()
    assert dg.plan(0, 8)(100) == dg.Spec() and dg.plan(16, 8)(100) == dg.Spec()
    assert dg.plan(3, 8)(100) == dg.Spec(8, 3)
    assert dg.plan(3, 8)(1) == dg.Spec(1, 0)  # a one-block tensor is always digested whole
    # N consecutive syncs cover every block of a large tensor
    phases = {dg.plan(s, 8)(100).phase for s in range(1, 8)} | {0}
    assert phases == set(range(8))


def test_compare_names_the_tensor_and_the_engine():
    want = {"a": [1, 0, 5], "b": [4, 2, 9]}
    dg.compare(want, {"a": 5, "b": 9}, engine="builtin engine 0", version=3)
    with pytest.raises(dg.WeightVerifyError, match=r"builtin engine 0: tensor 'b' after weight version 3: "
                                                   r"digest 0x00000008 != exported 0x00000009 \(blocks 2 mod 4\)"):
        dg.compare(want, {"a": 5, "b": 8}, engine="builtin engine 0", version=3)
    with pytest.raises(dg.WeightVerifyError, match="'a'.*not found"):
        dg.compare(want, {"b": 9}, engine="e", version=1)
