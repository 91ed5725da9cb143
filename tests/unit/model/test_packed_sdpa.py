"""PackedSDPAttention against a dense per-sequence reference: values and gradients, GQA, TP-local
heads, the layouts Megatron hands it, bad input, and no [S, S] tensor anywhere in forward+backward."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_maspo.model.config import ModelConfig
from megatron_maspo.train.actor.packing import cu_seqlens

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LENS = [5, 11, 1, 8, 3]  # unequal, including a one-token sequence


def _config(heads: int = 4, groups: int = 2, d: int = 8, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=d, attention_dropout=0.0,
                             use_cpu_initialization=True, **kw)


def _module(cfg, tp: int = 1, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_maspo.model.packed_attention import PackedSDPAttention

    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: tp, rank=lambda: 0))
    return PackedSDPAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pg, **kw)


def _reference(q, k, v, lens, scale):
    """Dense block-causal attention in float64: q [t, n, d], k/v [t, g, d] -> [t, n*d]."""
    n, g = q.shape[1], k.shape[1]
    k, v = (x.double().repeat_interleave(n // g, dim=1) for x in (k, v))
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    t = q.shape[0]
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & (ids[:, None] == ids[None, :])
    s = torch.einsum("qnd,knd->nqk", q.double(), k) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("nqk,knd->qnd", p, v).reshape(t, -1)


def _qkv(t, n, g, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=gen).requires_grad_() for h in (n, g, g)]


def _grads(out, inputs, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 4, 1), (8, 4, 2)])
def test_thd_matches_reference_values_and_grads(heads, groups, tp):
    from megatron_maspo.model.packed_attention import build_packed_seq_params

    d = 8
    m = _module(_config(heads, groups, d), tp=tp)
    n, g = heads // tp, groups // tp  # the module sees this TP rank's heads only
    assert (m.num_heads, m.num_groups) == (n, g)
    q, k, v = _qkv(sum(LENS), n, g, d)
    out = m(q, k, v, None, packed_seq_params=build_packed_seq_params(cu_seqlens(LENS)))
    ref = _reference(q, k, v, LENS, 1 / math.sqrt(d))
    assert out.shape == (sum(LENS), n * d)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def test_softmax_scale_and_sbhd_layouts():
    from megatron_maspo.model.packed_attention import build_packed_seq_params

    m = _module(_config(), softmax_scale=0.3)
    q, k, v = _qkv(sum(LENS), 4, 2, 8, seed=3)
    ref = _reference(q, k, v, LENS, 0.3)
    params = build_packed_seq_params(cu_seqlens(LENS))
    params.qkv_format = "sbhd"  # packed sbhd: [s, b=1, n, d]
    out = m(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)
    assert out.shape == (sum(LENS), 1, 32)
    torch.testing.assert_close(out[:, 0].double(), ref, rtol=1e-5, atol=1e-6)
    # unpacked [s, b, n, d] rows, plain causal (what GPTModel passes without packed_seq_params)
    qb, kb, vb = (torch.stack([x[:8], x[8:16]], dim=1) for x in (q, k, v))
    out = m(qb, kb, vb, None)
    for b in range(2):
        want = _reference(qb[:, b], kb[:, b], vb[:, b], [8], 0.3)
        torch.testing.assert_close(out[:, b].double(), want, rtol=1e-5, atol=1e-6)
    # unpacked with the caller's dense block-causal mask (True = masked out)
    from megatron_maspo.train.actor.packing import block_causal_mask

    out = m(q[:, None], k[:, None], v[:, None], block_causal_mask(LENS))
    torch.testing.assert_close(out[:, 0].double(), ref, rtol=1e-5, atol=1e-6)


def test_bad_input_and_unsupported_configs_raise():
    from megatron_maspo.model.packed_attention import HostPackedSeqParams, build_packed_seq_params

    m = _module(_config())
    q, k, v = _qkv(10, 4, 2, 8)
    with pytest.raises(ValueError, match="packed length 10"):
        m(q, k, v, None, packed_seq_params=build_packed_seq_params([0, 4, 9]))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_kv must equal"):
        m(q, k, v, None, packed_seq_params=HostPackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 5, 10], dtype=torch.int32),
            max_seqlen_q=6, max_seqlen_kv=6))
    with pytest.raises(ValueError, match="strictly increase"):
        build_packed_seq_params([0, 3, 3])
    with pytest.raises(ValueError, match="sliding-window"):
        _module(_config(window_size=(4, 0)))
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flash")


def test_te_backend_is_refused_at_start_up_without_te():
    from megatron_maspo.model.provider import attention_options
    from megatron_maspo.model.te_spec import te_available

    if te_available():
        pytest.skip("Transformer Engine and CUDA present")
    with pytest.raises((ImportError, RuntimeError), match="attention_backend='te'"):
        attention_options("te", 2)
    assert attention_options("packed_sdpa", 2) == {"attention_backend": "packed_sdpa", "use_te": False,
                                                   "sequence_parallel": False}


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and autograd backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_quadratic_tensor_in_forward_and_backward():
    from megatron_maspo.model.packed_attention import build_packed_seq_params

    lens = [300, 200, 500, 24]
    s = sum(lens)
    m = _module(_config())
    q, k, v = _qkv(s, 4, 2, 8)
    params = build_packed_seq_params(cu_seqlens(lens))
    with _LargestTensor() as probe:
        out = m(q, k, v, None, packed_seq_params=params)
        _grads(out, (q, k, v))
    assert probe.numel <= 4 * s * 8  # [t, heads, d]: linear in S
    # the probe sees quadratic tensors when they exist (the dense reference's [heads, S, S])
    with _LargestTensor() as dense:
        _reference(q, k, v, lens, 0.1)
    assert dense.numel >= s * s
