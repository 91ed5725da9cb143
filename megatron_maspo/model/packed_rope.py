"""Rotary embedding of packed (``thd``) rows without a host sync per layer (the local, non-TE spec).

Megatron-Core 0.16.1's unfused thd path (``rope_utils._apply_rotary_pos_emb_thd``, used whenever TE's
fused RoPE is absent) reads the sequence lengths with ``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()``
and compares ``freqs.size(0) == cu_seqlens[-1]``: two device-to-host syncs per call, i.e. per layer for
the query and again for the key, in the forward, the recompute and every micro-batch. Each packed row's
bounds are known on the host when its ``PackedSeqParams`` is built
(:func:`~.packed_attention.build_packed_seq_params`), so they are attached to the ``cu_seqlens`` tensor
(:func:`tag_host_bounds`) and the replacement below builds the per-token rotary table once per micro-batch
(a position index, then one ``index_select`` of ``freqs``, cached on the tensor) and reuses it in every
layer. The result equals Megatron's bit for bit (the same slices of ``freqs``, concatenated); anything
this does not cover (context parallelism, freqs spanning the whole row with several sequences, a tensor
without host bounds) goes to Megatron's own function.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_maspo.model import mcore_compat

_HOST = "_maspo_host_bounds"
_CACHE = "_maspo_rope_cache"
_installed = False


def tag_host_bounds(cu_seqlens: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Attach the host copy of ``cu_seqlens`` (and install the sync-free thd RoPE once); returns it."""
    setattr(cu_seqlens, _HOST, list(bounds))
    install()
    return cu_seqlens


def install() -> None:
    """Route megatron-core's unfused thd RoPE through :func:`packed_thd_rope` (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def patched(t, cu_seqlens, freqs, rotary_interleaved=False, mla=None, mscale=1.0, cp_group=None,
                **kwargs):
        # The MLA flag is ``multi_latent_attention=`` on megatron-core 0.16.1, ``mla_rotary_interleaved=``
        # on 0.19 (mcore_compat); it sits in the same positional slot on both.
        multi_latent_attention = mcore_compat.pop_rope_mla_flag(kwargs, default=bool(mla))
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        out = packed_thd_rope(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                              multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        if out is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved, mscale=mscale,
                            cp_group=cp_group,
                            **mcore_compat.rope_mla_kwargs(multi_latent_attention))  # type: ignore[arg-type]
        return out

    patched.maspo_original = original  # type: ignore[attr-defined]
    rope_utils._apply_rotary_pos_emb_thd = patched
    _installed = True


def packed_freqs(cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor | None:
    """``freqs`` rows for every token of the row, positions restarting at each sequence ``[t, 1, 1, d]``
    (cached on ``cu_seqlens`` for this ``freqs``); None when ``cu_seqlens`` has no host bounds."""
    bounds = getattr(cu_seqlens, _HOST, None)
    if bounds is None:
        return None
    key = (freqs.data_ptr(), tuple(freqs.shape), freqs.dtype, freqs.device, freqs._version)
    cached = getattr(cu_seqlens, _CACHE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    pos = torch.cat([torch.arange(n) for n in lens]).to(freqs.device, non_blocking=True)
    table = freqs.index_select(0, pos)
    setattr(cu_seqlens, _CACHE, (key, table))
    return table


def packed_thd_rope(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *,
                    rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                    mscale: float = 1.0, cp_group: Any = None) -> torch.Tensor | None:
    """Megatron's thd RoPE (``CASE 2``: positions restart per sequence) from host bounds, or None where
    Megatron's own function must run."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    bounds = getattr(cu_seqlens, _HOST, None)
    if bounds is None or (cp_group is not None and cp_group.size() != 1):
        return None
    if freqs.dim() >= 1 and freqs.size(0) == bounds[-1] and len(bounds) > 2:
        return None  # freqs over the whole row: Megatron's offset mapping (CASE 1)
    table = packed_freqs(cu_seqlens, freqs)
    assert table is not None  # bounds checked above
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), table, rotary_interleaved=rotary_interleaved, mscale=mscale,
                                      **mcore_compat.rope_mla_kwargs(multi_latent_attention)).squeeze(1)
