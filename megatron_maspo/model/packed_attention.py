"""Packed-sequence core attention for the local (non-TE) spec, linear in memory.

:class:`PackedSDPAttention` is a drop-in for the local spec's ``core_attention`` submodule (same
constructor as Megatron-Core's ``DotProductAttention``). Given Megatron's packed-sequence interface
(:class:`PackedSeqParams` with ``cu_seqlens``), it runs causal attention **per sequence** through
``torch.nn.functional.scaled_dot_product_attention`` on that sequence's slice: the flash kernel on
GPU, the fused flash kernel on CPU. Neither materialises a score matrix, so memory is linear in the
row length S (Megatron's ``DotProductAttention`` holds ``[b*heads, S, S]`` scores plus a
``[1, 1, S, S]`` mask). Grouped-query attention passes K/V with their ``n_g`` heads
(``enable_gqa=True``), never repeated.

Layouts (Megatron is sequence-first; the module sees this TP rank's heads only):

* ``thd`` (``packed_seq_params.qkv_format == "thd"``): q ``[t, n_h/tp, d]``, k/v ``[t, n_g/tp, d]``
  → ``[t, n_h/tp * d]``; ``attention.py`` reshapes it to ``[t, 1, h/tp]``.
* ``sbhd`` with ``packed_seq_params`` (b must be 1) or without it (plain causal over each row, or
  the caller's dense ``attention_mask``): q ``[s, b, n_h/tp, d]`` → ``[s, b, n_h/tp * d]``.

Rotary positions restart per sequence on the thd path through Megatron's own
``apply_rotary_pos_emb(..., cu_seqlens=...)`` (``attention.py`` calls it before this module), so
nothing here touches positions.

Context parallelism (``context_parallel_size = cp > 1``, thd only): ``cu_seqlens`` are the global
bounds, each sequence padded to a multiple of ``2·cp``, and this rank holds chunks ``r`` and
``2cp-1-r`` of every sequence (:mod:`megatron_maspo.parallel.context_parallel`; Megatron's thd
rotary gives those rows their true positions). K and V of the row are all-gathered over the CP
group once per layer (``[S, 2·n_g, d]``: linear in S, backward a reduce-scatter), and each local
chunk ``j`` attends to its sequence's keys ``[0, (j+1)·c)`` with the causal diagonal aligned to
the bottom right; query blocks of at most ``CP_QUERY_BLOCK`` rows bound the boolean mask to
``[block, L]`` bytes, so no ``[S, S]`` tensor exists. Padding sits at the end of each sequence, so
causality already hides it from every real token.

Numerics: ``apply_query_key_layer_scaling`` divides the scale by ``layer_number`` and Megatron's
softmax multiplies it back, so the effective scale is the plain ``softmax_scale`` used here. The
kernels accumulate in fp32 whatever the input dtype. Dropout (0 in RL) is honoured; CPU's fused
kernels lack it, so with dropout > 0 CPU falls back to PyTorch's math kernel, which holds one
sequence's ``[heads, L, L]`` (never the row's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_maspo.parallel.context_parallel import cp_gather_order, gather_cp, local_bounds

CP_QUERY_BLOCK = 512
"""Query rows per SDPA call on the CP path: the lower-right causal mask is ``[block, L]`` bool."""


class PackedSDPAttention(MegatronModule):
    """Causal core attention per packed sequence through fused SDPA kernels; no ``[S, S]`` tensor.

    Args: as Megatron-Core 0.16.1 ``DotProductAttention`` (``cp_comm_type`` is accepted and
    ignored: at ``cp > 1`` K/V are always all-gathered, see the module docstring).

    Raises:
        ValueError: a config this module does not implement (sliding window, non-vanilla softmax).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, k_channels: int | None = None,
                 v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.window_size is not None:
            raise ValueError("model.attention_backend='packed_sdpa' does not implement sliding-window "
                             f"attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            raise ValueError(f"model.attention_backend='packed_sdpa' supports softmax_type='vanilla' "
                             f"only, got {config.softmax_type!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            required = ["tp", "cp"] if config.context_parallel_size > 1 else ["tp"]
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None) if self.cp > 1 else None
        if self.cp > 1 and (self.cp_group is None or self.cp_group.size() != self.cp):
            raise ValueError(f"context_parallel_size={self.cp} but the CP process group is missing "
                             "or of another size")
        tp = self.tp_group.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        # MLA passes its key head width (nope + rotary dims) and its own softmax scale; the value width
        # v_channels needs nothing here (SDPA takes value heads of any width, the output has it)
        head_dim = k_channels or config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    # ------------------------------------------------------------------ kernels
    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[B, n_h, L, d]``, k/v ``[B, n_g, L, d]`` → ``[B, n_h, L, d]``."""
        p = float(self.dropout_p) if self.training else 0.0

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None,
                scale=self.softmax_scale, enable_gqa=q.shape[-3] != k.shape[-3])

        if p > 0.0 and not self.config.sequence_parallel:
            # the same RNG stream Megatron's DotProductAttention drops attention probs with
            tracker: Any = tensor_parallel.get_cuda_rng_tracker()
            with tracker.fork():
                return run()
        return run()

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bounds: list[int]) -> torch.Tensor:
        """q ``[t, n_h, d]``, k/v ``[t, n_g, d]``, ``bounds`` = host cu_seqlens → ``[t, n_h, d]``."""
        if bounds[0] != 0 or bounds[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {q.shape[0]}, got "
                             f"{bounds[0]}..{bounds[-1]}")
        causal = self.attn_mask_type != AttnMaskType.no_mask
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b <= a:
                continue  # zero-length sequence (cu_seqlens padding entries)
            # [L, n, d] -> [1, n, L, d]: strided views, the kernels accept them
            qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            outs.append(self._sdpa(qs, ks, vs, causal=causal)[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0].contiguous()

    def _lower_right(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the *last* ``Lq`` key positions' queries: q ``[1, n_h, Lq, d]``,
        k/v ``[1, n_g, Lk, d]`` (Lk >= Lq) → ``[1, n_h, Lq, d]``; query ``i`` sees keys
        ``<= Lk - Lq + i``. Blocks of ``CP_QUERY_BLOCK`` rows keep the mask at ``[block, Lk]``."""
        lq, lk = q.shape[2], k.shape[2]
        if lq == lk:
            return self._sdpa(q, k, v, causal=True)
        outs = []
        for q0 in range(0, lq, CP_QUERY_BLOCK):
            q1 = min(lq, q0 + CP_QUERY_BLOCK)
            end = lk - lq + q1  # keys past the block's last query are never seen
            rows = torch.arange(lk - lq + q0, end, device=q.device).view(-1, 1)
            mask = torch.arange(end, device=q.device).view(1, -1) <= rows  # True = attend
            outs.append(self._sdpa(q[:, :, q0:q1], k[:, :, :end], v[:, :, :end], causal=False,
                                   mask=mask))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _packed_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bounds: list[int]) -> torch.Tensor:
        """CP rank ``r``'s queries over the gathered keys; q ``[t, n_h, d]``, k/v ``[t, n_g, d]``
        with ``t = S/cp`` local rows, ``bounds`` the global padded cu_seqlens → ``[t, n_h, d]``."""
        if self.attn_mask_type == AttnMaskType.no_mask:
            raise ValueError("context parallelism on packed_sdpa implements causal attention only")
        cp, r = self.cp, self.cp_group.rank()
        loc = local_bounds(bounds, cp)
        if loc[0] != 0 or loc[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens (global, ÷cp={cp}) must run from 0 to the local packed "
                             f"length {q.shape[0]}, got {loc[0]}..{loc[-1]}")
        order = cp_gather_order(bounds, cp).to(k.device)
        if k.shape[-1] == v.shape[-1]:  # one gather of [S, 2·n_g, d], rank order -> global order
            kv = gather_cp(torch.cat([k, v], dim=1), self.cp_group).index_select(0, order)
            k_all, v_all = kv[:, :k.shape[1]], kv[:, k.shape[1]:]
        else:  # MLA: key and value heads differ in width, gathered apart
            k_all, v_all = (gather_cp(x.contiguous(), self.cp_group).index_select(0, order) for x in (k, v))
        outs = []
        for a, b, la in zip(bounds[:-1], bounds[1:], loc[:-1]):
            if b <= a:
                continue
            c = (b - a) // (2 * cp)
            k_seq, v_seq = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (k_all, v_all))  # [1, n_g, L, d]
            for half, j in enumerate((r, 2 * cp - 1 - r)):
                qs = q[la + half * c:la + (half + 1) * c].transpose(0, 1).unsqueeze(0)
                ks, vs = k_seq[:, :, :(j + 1) * c], v_seq[:, :, :(j + 1) * c]
                outs.append(self._lower_right(qs, ks, vs)[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0].contiguous()

    # ------------------------------------------------------------------ forward
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Attention context: ``[t, n_h/tp * d]`` (thd) or ``[s, b, n_h/tp * d]`` (sbhd).

        Args:
            query: ``[t, n_h/tp, d]`` (thd) or ``[s, b, n_h/tp, d]``.
            key, value: the same with ``n_g/tp`` heads.
            attention_mask: ignored when ``packed_seq_params`` is given; otherwise an optional
                ``[b or 1, 1, s, s]`` bool mask (True = masked out), O(s²) by the caller's choice.
            packed_seq_params: ``cu_seqlens_q`` [n+1] int32 sequence starts in the packed row
                (``cu_seqlens_kv`` must be equal: self-attention).
        """
        if attention_bias is not None:
            raise ValueError("PackedSDPAttention does not take an attention_bias")
        if packed_seq_params is not None:
            bounds = packed_bounds(packed_seq_params)
            if packed_seq_params.qkv_format == "thd":
                run = self._packed_cp if self.cp > 1 else self._packed
                out = run(query, key, value, bounds)
                return out.reshape(out.shape[0], -1)
            if query.shape[1] != 1:
                raise ValueError(f"packed sbhd input needs batch 1, got {query.shape[1]}")
            if self.cp > 1:
                raise ValueError("context parallelism on packed_sdpa needs the thd layout")
            out = self._packed(query[:, 0], key[:, 0], value[:, 0], bounds)
            return out.reshape(out.shape[0], 1, -1)
        if self.cp > 1:
            raise ValueError("context parallelism on packed_sdpa needs packed_seq_params (thd)")
        # unpacked [s, b, n, d]: rows are independent sequences
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
        mask = None if attention_mask is None else ~attention_mask
        causal = (attn_mask_type or self.attn_mask_type) != AttnMaskType.no_mask
        out = self._sdpa(q, k, v, causal=causal, mask=mask)  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def packed_bounds(params: PackedSeqParams) -> list[int]:
    """Host copy of ``cu_seqlens_q`` (``[n+1]`` ints), checked equal to ``cu_seqlens_kv``.

    :class:`HostPackedSeqParams` carries it already, so a GPU run does not synchronise per layer.
    """
    host = getattr(params, "cu_seqlens_host", None)
    if host is not None:
        return host
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required")
    if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q and \
            not torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q):
        raise ValueError("PackedSDPAttention is self-attention: cu_seqlens_kv must equal cu_seqlens_q")
    return [int(x) for x in params.cu_seqlens_q.tolist()]


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` plus a host copy of the sequence bounds.

    ``cu_seqlens_host`` saves one device→host copy per layer in :class:`PackedSDPAttention`;
    Transformer Engine and Megatron's rotary code read the usual fields and ignore it.
    """

    cu_seqlens_host: list[int] | None = None


def build_packed_seq_params(bounds: list[int], device: torch.device | None = None
                            ) -> HostPackedSeqParams:
    """thd ``PackedSeqParams`` for one packed row with sequence bounds ``bounds``.

    Args:
        bounds: ``cu_seqlens`` as host ints, ``[0, n_0, n_0 + n_1, ..., S]``, strictly increasing
            (``train.actor.packing.cu_seqlens``).
        device: where the ``cu_seqlens`` tensor lives (the compute device; TE needs the GPU).

    Returns:
        params with ``cu_seqlens_q = cu_seqlens_kv`` ``[n+1]`` int32 and ``max_seqlen_q/kv`` = the
        longest sequence. Megatron sizes its rotary table by ``max_seqlen`` and, on the thd path,
        applies it to every sequence from position 0: positions restart at each boundary.
    """
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if len(bounds) < 2 or bounds[0] != 0 or min(lens) <= 0:
        raise ValueError(f"bounds must start at 0 and strictly increase, got {bounds[:8]}...")
    from megatron_maspo.model.packed_rope import tag_host_bounds

    cu = tag_host_bounds(torch.tensor(bounds, dtype=torch.int32, device=device), bounds)  # RoPE: no sync
    longest = max(lens)
    return HostPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest,
                               cu_seqlens_host=list(bounds))
