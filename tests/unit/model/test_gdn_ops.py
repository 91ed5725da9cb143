"""Gated DeltaNet maths (``model/gdn_ops.py``), kernel choice (``gdn_kernels.py``) and row layout
(``gdn_layout.py``): the packed chunked form against the token-by-token recurrence per sequence
(values, final states, gradients), the packed conv against ``F.conv1d`` per sequence, the torch
kernel chosen when fla is absent, and the HF <-> fused permutations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_maspo.model import gdn_kernels
from megatron_maspo.model.gdn_layout import (
    GdnDims,
    conv_rows_for_rank,
    fuse_conv,
    fuse_in_proj,
    split_conv,
    split_in_proj,
)
from megatron_maspo.model.gdn_ops import (
    packed_causal_conv1d,
    packed_chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

BOUNDS = [0, 11, 13, 13, 36]  # 11, 2, an empty entry, 23


def _inputs(t=36, h=3, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(t, h, dv, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(t, h, generator=gen, dtype=torch.float64))
    beta = torch.rand(t, h, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _alone(xs, bounds):
    outs, states = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            o, s = recurrent_gated_delta_rule(*(x[a:b].unsqueeze(0) for x in xs))
            outs.append(o[0])
            states.append(s[0])
    return torch.cat(outs), torch.stack(states)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_packed_chunked_equals_recurrence_per_sequence(chunk):
    xs = _inputs()
    o, s = packed_chunk_gated_delta_rule(*xs, BOUNDS, chunk_size=chunk)
    ro, rs = _alone(xs, BOUNDS)
    assert (o - ro).abs().max() < 1e-6 and (s.double() - rs.double()).abs().max() < 1e-6
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=o.dtype)
    grads = torch.autograd.grad((o * w).sum(), xs)
    ref = torch.autograd.grad((ro * w).sum(), xs)
    for a, b in zip(grads, ref):
        assert (a - b).abs().max() < 1e-6


def test_state_does_not_leak_control():
    """Control: the same tokens as one sequence give a different second sequence."""
    xs = _inputs()
    o, _ = packed_chunk_gated_delta_rule(*xs, BOUNDS, chunk_size=4)
    joined, _ = packed_chunk_gated_delta_rule(*xs, [0, 36], chunk_size=4)
    assert torch.allclose(o[:11], joined[:11]) and (o[11:] - joined[11:]).abs().max() > 1e-3


def test_initial_state_continues_a_sequence():
    """Splitting one sequence and passing the first half's final state reproduces it whole."""
    xs = _inputs()
    whole, s_whole = packed_chunk_gated_delta_rule(*xs, [0, 36], chunk_size=4)
    first, s1 = packed_chunk_gated_delta_rule(*(x[:15] for x in xs), [0, 15], chunk_size=4)
    rest, s2 = packed_chunk_gated_delta_rule(*(x[15:] for x in xs), [0, 21], chunk_size=4, initial_state=s1)
    assert (torch.cat([first, rest]) - whole).abs().max() < 1e-6 and (s2 - s_whole).abs().max() < 1e-6


def test_packed_conv_resets_per_sequence():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(36, 5, generator=gen), torch.randn(5, 4, generator=gen)
    y = packed_causal_conv1d(x, w, BOUNDS)
    for a, b in zip(BOUNDS[:-1], BOUNDS[1:]):
        if b > a:
            ref = F.conv1d(x[a:b].T[None], w[:, None], padding=3, groups=5)[0, :, :b - a].T
            assert torch.allclose(y[a:b], F.silu(ref), atol=1e-6)


def test_bad_bounds_are_refused():
    xs = _inputs()
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        packed_chunk_gated_delta_rule(*xs, [0, 10, 30], chunk_size=4)


def test_torch_kernel_without_fla(monkeypatch):
    """fla is not installed here (and must stay out of CPU installs): auto picks torch; on CPU even an
    installed fla is not used; asking for fla where it cannot run is an error."""
    assert not gdn_kernels.fla_installed()
    assert gdn_kernels.gdn_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs the flash-linear-attention package"):
        gdn_kernels.gdn_backend("fla", torch.device("cpu"))
    monkeypatch.setattr(gdn_kernels, "fla_installed", lambda: True)
    assert gdn_kernels.gdn_backend("auto", torch.device("cpu")) == "torch"
    assert gdn_kernels.gdn_backend("auto", torch.device("cuda")) == "fla"
    with pytest.raises(ValueError, match="gdn backend 'nope'"):
        gdn_kernels.gdn_backend("nope", torch.device("cpu"))
    xs = _inputs()
    o = gdn_kernels.chunk_gated_delta_rule(*xs, BOUNDS, chunk_size=4)
    assert torch.equal(o, packed_chunk_gated_delta_rule(*xs, BOUNDS, chunk_size=4)[0])


DIMS = GdnDims(num_key_heads=4, num_value_heads=8, key_head_dim=3, value_head_dim=2, conv_kernel=4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_round_trip_and_rank_slices(tp):
    qk, _, vd, _, nv, _ = DIMS.part_sizes()
    rows = 2 * qk + vd
    qkv, z = torch.arange(rows * 1.0)[:, None], 1000 + torch.arange(vd * 1.0)[:, None]
    b, a = 2000 + torch.arange(nv * 1.0)[:, None], 3000 + torch.arange(nv * 1.0)[:, None]
    fused = fuse_in_proj(qkv, z, b, a, DIMS, tp)
    for x, y in zip(split_in_proj(fused, DIMS, tp), (qkv, z, b, a)):
        assert torch.equal(x, y)
    r = tp - 1  # the last rank: its q heads, then its k, v, z, b, a heads
    mine = fused.chunk(tp)[r][:, 0]
    qr, vr, hr = qk // tp, vd // tp, nv // tp
    want = torch.cat([torch.arange(r * qr, (r + 1) * qr), qk + torch.arange(r * qr, (r + 1) * qr),
                      2 * qk + torch.arange(r * vr, (r + 1) * vr), 1000 + torch.arange(r * vr, (r + 1) * vr),
                      2000 + torch.arange(r * hr, (r + 1) * hr), 3000 + torch.arange(r * hr, (r + 1) * hr)])
    assert torch.equal(mine, want.float())
    conv = torch.randn(rows, 1, 4)
    assert torch.equal(split_conv(fuse_conv(conv, DIMS, tp), DIMS, tp), conv)
    assert torch.equal(fuse_conv(conv, DIMS, tp).chunk(tp)[r], conv[conv_rows_for_rank(DIMS, tp, r)])


def test_dims_validation():
    with pytest.raises(ValueError, match="not a multiple of num_key_heads"):
        GdnDims(num_key_heads=3, num_value_heads=4, key_head_dim=2, value_head_dim=2)
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size=8"):
        DIMS.check_tp(8)
    assert DIMS.recurrent_state_numel() == 8 * 3 * 2 + (2 * 12 + 16) * 3


def test_context_parallel_is_refused():
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_maspo.model.gdn import GatedDeltaNet

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, context_parallel_size=2,
                            use_cpu_initialization=True)
    with pytest.raises(ValueError, match="does not support context parallelism"):
        GatedDeltaNet(cfg, 1, DIMS, pg_collection=SimpleNamespace(tp=None))


def test_auto_refuses_the_torch_loop_on_cuda_without_fla(monkeypatch):
    """On CUDA without fla, ``auto`` used to run the pure-torch chunk loop silently (a GPU job then trains
    the GDN layers at a fraction of the speed with ~1 GB of saved state per layer at 32k tokens): it is an
    error naming the extra, and only an explicit ``torch`` (or ``MASPO_GDN_BACKEND=torch``) runs it there."""
    monkeypatch.setattr(gdn_kernels, "fla_installed", lambda: False)
    monkeypatch.delenv(gdn_kernels.ENV, raising=False)
    with pytest.raises(ValueError, match=r"install the gdn extra \(flash-linear-attention>=0.4.2\)"):
        gdn_kernels.gdn_backend("auto", torch.device("cuda"))
    assert gdn_kernels.gdn_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setenv(gdn_kernels.ENV, "torch")
    assert gdn_kernels.gdn_backend("auto", torch.device("cuda")) == "torch"
    monkeypatch.setenv(gdn_kernels.ENV, "triton")
    with pytest.raises(ValueError, match="MASPO_GDN_BACKEND='triton'"):
        gdn_kernels.gdn_backend("auto", torch.device("cuda"))


def test_the_gdn_extra_admits_no_fla_without_the_host_bounds_argument():
    """The kernel call passes ``cu_seqlens_cpu``, which fla-core has from 0.4.2 (0.3.x raises TypeError on
    it, 0.4.0-0.4.1 swallow it): the extra's lower bound is that release."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    meta = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in meta["project"]["optional-dependencies"]["gdn"]]
    assert req.name == "flash-linear-attention"
    assert not req.specifier.contains(Version("0.4.1")) and not req.specifier.contains(Version("0.3.2"))
    assert req.specifier.contains(Version("0.4.2"))
