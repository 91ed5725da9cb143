"""``model.attention_backend='varlen'``: one variable-length flash kernel call per layer (GPU only).

:class:`~.packed_attention.PackedSDPAttention` (the default, ``packed_sdpa``) runs one SDPA call per
sequence per layer and reads the bounds on the host. :class:`VarlenAttention` hands the whole packed row
to PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernel) with the device
``cu_seqlens`` Megatron already carries, so a layer costs one kernel launch and no host synchronisation:

    q [t, n_h/tp, d], k/v [t, n_g/tp, d], cu_seqlens [n+1] int32 (device), max_seqlen
      -> varlen_attn(q, k, v, cu, cu, max, max, window_size=(-1, 0) causal, enable_gqa=n_h != n_g)
         (torch < 2.13 has no enable_gqa: K/V heads are repeated to n_h instead, ``varlen_call``)
      -> [t, n_h/tp * d]

Same module interface and parameters as ``packed_sdpa`` (core attention has none), so checkpoints,
conversion tables and weight sync are unchanged. Unpacked ``sbhd`` input falls back to the SDPA path.

**Written, not run**: the kernel has no CPU implementation in torch 2.13 and no GPU was available when it
was written; ``attention_options('varlen', ...)`` refuses it without CUDA, and
``tests/gpu/test_packed_attention_gpu.py::test_varlen_matches_packed_sdpa_on_gpu`` (in the GPU smoke
script) compares it with ``packed_sdpa``. ``packed_sdpa`` stays the default until a device has run it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_maspo.model.packed_attention import PackedSDPAttention
from megatron_maspo.parallel.device import on_cuda


def require_varlen() -> None:
    """Raise ``RuntimeError`` unless the varlen kernel can run here (CUDA and torch's varlen module)."""
    if not on_cuda():
        raise RuntimeError("model.attention_backend='varlen' needs a CUDA device (FlashAttention's varlen "
                           "kernel has no CPU implementation); use attention_backend='packed_sdpa'")
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as e:
        raise RuntimeError("model.attention_backend='varlen' needs torch.nn.attention.varlen (torch >= 2.9)") from e


@functools.cache
def kernel_args(kernel: Callable[..., Any]) -> frozenset[str]:
    """The keyword arguments ``kernel`` (torch's ``varlen_attn``) takes; read once per kernel.

    Its surface moved between releases: torch 2.13 has ``scale``, ``window_size`` and ``enable_gqa``;
    torch 2.11 (the GPU smoke machine's) has no ``enable_gqa`` and raises ``TypeError`` on it; earlier ones
    had ``is_causal`` instead of ``window_size`` and no ``scale``.
    """
    try:
        return frozenset(inspect.signature(kernel).parameters)
    except (TypeError, ValueError):  # no readable signature: assume the oldest surface
        return frozenset()


def takes_enable_gqa(kernel: Callable[..., Any]) -> bool:
    """Whether ``kernel`` groups query heads over fewer K/V heads itself (``enable_gqa``)."""
    return "enable_gqa" in kernel_args(kernel)


def varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, *,
                scale: float, causal: bool, kernel: Callable[..., Any] | None = None) -> tuple[tuple, dict[str, Any]]:
    """The ``kernel`` arguments for one packed row: (args, kwargs). A pure function, so the translation from
    Megatron's packed layout is testable without the kernel.

    ``kernel`` (default torch's ``varlen_attn``) is only inspected (:func:`kernel_args`), and the same
    attention is asked of whichever surface it has: without ``enable_gqa`` grouped-query K/V
    ``[t, n_g, d]`` are repeated to ``[t, n_h, d]`` (each K/V head serves its ``n_h/n_g`` consecutive query
    heads, as ``enable_gqa`` and SDPA do; n_h/n_g times one layer's K/V memory); without ``window_size``
    the causal flag is ``is_causal``; without ``scale`` q is pre-scaled so the kernel's default
    ``d**-0.5`` gives ``scale``.

    A value head narrower than the query/key head (MLA: d_v = 128, d_qk = 192 in DeepSeek-V3) is padded with
    zeros to ``d_qk``: FlashAttention-2's varlen kernel checks that ``v`` has the query's head size and
    refuses anything else. The padded columns of ``softmax(q k^T) v`` are zero, so the caller keeps the
    first ``d_v`` columns of the output (:class:`VarlenAttention` does) and the result, gradients included,
    is the unpadded attention's; the cost is ``d_qk / d_v`` times the V reads and output writes.
    """
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel
    names = kernel_args(kernel)
    if cu.dtype != torch.int32:
        cu = cu.to(torch.int32)
    kwargs: dict[str, Any] = {}
    if "scale" in names:
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in names or "is_causal" not in names:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    gqa = q.shape[1] != k.shape[1]
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = gqa
    elif gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if v.shape[-1] != q.shape[-1]:
        if v.shape[-1] > q.shape[-1]:
            raise ValueError(f"varlen attention: value head dim {v.shape[-1]} > query/key head dim {q.shape[-1]}"
                             "; use attention_backend='packed_sdpa'")
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
    return (q, k, v, cu, cu, int(max_len), int(max_len)), kwargs


class VarlenAttention(PackedSDPAttention):
    """:class:`PackedSDPAttention` whose packed path is one ``varlen_attn`` call (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.dropout_p:
            raise ValueError(f"model.attention_backend='varlen' has no attention dropout (got "
                             f"{self.dropout_p}); use attention_backend='packed_sdpa'")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or attention_bias is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        from torch.nn.attention.varlen import varlen_attn

        thd = packed_seq_params.qkv_format == "thd"
        q, k, v = (x if thd else x[:, 0] for x in (query, key, value))  # sbhd packed rows have batch 1
        cu = packed_seq_params.cu_seqlens_q
        max_len = packed_seq_params.max_seqlen_q
        if max_len is None:  # only the host bounds give it without a device sync
            bounds = getattr(packed_seq_params, "cu_seqlens_host", None) or cu.tolist()
            max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        args, kw = varlen_call(q, k, v, cu, max_len, scale=self.softmax_scale,
                               causal=self.attn_mask_type != AttnMaskType.no_mask, kernel=varlen_attn)
        out = varlen_attn(*args, **kw)  # [t, n_h/tp, d_qk]
        out = out[..., :v.shape[-1]]  # [t, n_h/tp, d_v]: the zero columns of an MLA value padding dropped
        return out.reshape(out.shape[0], -1) if thd else out.reshape(out.shape[0], 1, -1)
