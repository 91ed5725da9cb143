"""``attention_backend='varlen'`` (GPU only, written, not run): selected by the setting, refused clearly on
CPU, same parameters as ``packed_sdpa``, and its call arguments express the same attention: the varlen
semantics (causal window, GQA, int32 cu_seqlens) evaluated sequence by sequence equal PackedSDPAttention; a
kernel without ``enable_gqa`` (torch 2.11's) gets repeated K/V heads and gives the same output."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from megatron_maspo.model.provider import ModelBuildOptions, attention_options, layer_spec
from megatron_maspo.model.varlen_attention import VarlenAttention, varlen_call
from tests.unit.model.test_te_names import DENSE


def test_setting_selects_the_varlen_core_attention_and_cpu_refuses_it():
    lspec = layer_spec(DENSE, ModelBuildOptions(attention_backend="varlen"))
    assert lspec.submodules.self_attention.submodules.core_attention is VarlenAttention
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="varlen' needs a CUDA device"):
            attention_options("varlen", 1)


def _varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """What FlashAttention's varlen call computes, sequence by sequence (the documented contract)."""
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    b = cu_q.tolist()
    assert max(e - s for s, e in zip(b[:-1], b[1:])) == max_q
    causal = window_size == (-1, 0)
    outs = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=causal,
                                           scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
            for s, e in zip(b[:-1], b[1:])]
    return torch.cat(outs)


def test_call_arguments_mean_the_packed_causal_gqa_attention():
    g = torch.Generator().manual_seed(0)
    bounds = [0, 5, 6, 17]
    q, k, v = (torch.randn(17, h, 8, generator=g) for h in (4, 2, 2))
    args, kw = varlen_call(q, k, v, torch.tensor(bounds, dtype=torch.int64), 11, scale=0.3, causal=True)
    assert kw == {"scale": 0.3, "window_size": (-1, 0), "enable_gqa": True}
    got = _varlen_semantics(*args, **kw)
    want = torch.cat([F.scaled_dot_product_attention(
        q[s:e].transpose(0, 1), k[s:e].repeat_interleave(2, 1).transpose(0, 1),
        v[s:e].repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.3).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(got, want)


def _new_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """torch 2.13's ``varlen_attn`` signature over the documented semantics."""
    return _varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=enable_gqa)


def _old_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.11's signature: no ``enable_gqa``, and its kernel wants as many K/V heads as query heads."""
    if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
        raise RuntimeError(f"old varlen kernel: {query.shape[1]} query heads, {key.shape[1]} K/V heads")
    return _varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=False)


def test_a_kernel_without_enable_gqa_gets_repeated_kv_heads_and_the_same_output():
    from torch.nn.attention.varlen import varlen_attn

    from megatron_maspo.model.varlen_attention import takes_enable_gqa

    assert takes_enable_gqa(_new_kernel) and not takes_enable_gqa(_old_kernel)
    assert takes_enable_gqa(varlen_attn) == ("enable_gqa" in inspect.signature(varlen_attn).parameters)
    g = torch.Generator().manual_seed(1)
    bounds = torch.tensor([0, 9, 10, 23], dtype=torch.int32)
    q, k, v = (torch.randn(23, h, 8, generator=g) for h in (6, 2, 2))
    args, kw = varlen_call(q, k, v, bounds, 13, scale=0.25, causal=True, kernel=_old_kernel)
    assert "enable_gqa" not in kw and args[1].shape == args[2].shape == (23, 6, 8)
    old = _old_kernel(*args, **kw)
    new_args, new_kw = varlen_call(q, k, v, bounds, 13, scale=0.25, causal=True, kernel=_new_kernel)
    assert new_kw["enable_gqa"] and new_args[1].shape == (23, 2, 8)  # no copy where the kernel groups heads
    torch.testing.assert_close(old, _new_kernel(*new_args, **new_kw))
    # equal head counts: nothing repeated, nothing the old kernel does not know passed
    args, kw = varlen_call(q, q, q, bounds, 13, scale=0.25, causal=False, kernel=_old_kernel)
    assert args[1] is q and kw == {"scale": 0.25, "window_size": (-1, -1)}


def _oldest_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """An older surface still: ``is_causal`` instead of ``window_size``, no ``scale`` (1/sqrt(d) inside)."""
    return _old_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                       window_size=(-1, 0) if is_causal else (-1, -1))


def test_a_kernel_without_window_size_or_scale_gets_is_causal_and_a_prescaled_query():
    g = torch.Generator().manual_seed(2)
    bounds = torch.tensor([0, 4, 11], dtype=torch.int32)
    q, k, v = (torch.randn(11, h, 16, generator=g) for h in (4, 1, 1))
    args, kw = varlen_call(q, k, v, bounds, 7, scale=0.1, causal=True, kernel=_oldest_kernel)
    assert kw == {"is_causal": True}
    want_args, want_kw = varlen_call(q, k, v, bounds, 7, scale=0.1, causal=True, kernel=_new_kernel)
    torch.testing.assert_close(_oldest_kernel(*args, **kw), _new_kernel(*want_args, **want_kw))


def _fa2_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """FlashAttention-2's shape check (``CHECK_SHAPE(v, total_k, num_heads_k, head_size)``): the value head
    size must be the query's; then the documented semantics."""
    if value.shape[-1] != query.shape[-1]:
        raise RuntimeError(f"v must have shape (total_k, num_heads_k, {query.shape[-1]}), got {tuple(value.shape)}")
    return _varlen_semantics(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=enable_gqa)


def test_an_mla_value_head_narrower_than_the_query_is_padded_and_the_output_sliced_back():
    """MLA (DeepSeek-V3: d_qk 192, d_v 128; here 24 and 16): the kernel gets v padded with zeros to d_qk, and
    the first d_v columns of its output are the unpadded attention, values and gradients."""
    g = torch.Generator().manual_seed(3)
    bounds = [0, 6, 7, 15]
    q = torch.randn(15, 4, 24, generator=g, requires_grad=True)
    k = torch.randn(15, 4, 24, generator=g, requires_grad=True)
    v = torch.randn(15, 4, 16, generator=g, requires_grad=True)
    args, kw = varlen_call(q, k, v, torch.tensor(bounds), 8, scale=0.2, causal=True, kernel=_fa2_kernel)
    assert args[2].shape == (15, 4, 24) and torch.equal(args[2][..., 16:], torch.zeros(15, 4, 8))
    got = _fa2_kernel(*args, **kw)[..., :16]
    want = torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                     scale=0.2).transpose(0, 1) for s, e in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="value head dim 24 > query/key head dim 16"):
        varlen_call(v, v, q, torch.tensor(bounds), 8, scale=0.2, causal=True, kernel=_fa2_kernel)
