"""Which gated-delta-rule kernel the trainer's Gated DeltaNet runs: ``fla`` (triton, GPU) or pure torch.

``fla`` (flash-linear-attention, installed by the ``gdn`` extra on GPU machines) has a varlen chunked
kernel with its own backward (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, fla-core 0.6: q/k
``[1, T, H, d_k]``, ``cu_seqlens`` ``[N+1]``, q/k L2 norm and the ``d_k^-1/2`` scale inside, as here);
it runs only on CUDA tensors. The pure-torch path
(:func:`megatron_maspo.model.gdn_ops.packed_chunk_gated_delta_rule`) runs anywhere and is the
reference. :func:`gdn_backend` picks: ``"auto"`` takes fla for CUDA inputs when it imports, torch
otherwise; ``"torch"`` and ``"fla"`` force one (``"fla"`` without fla, or on CPU, is an error, never a
silent fallback). This module is the only importer of ``fla``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Literal

import torch

from megatron_maspo.model.gdn_ops import packed_chunk_gated_delta_rule

Backend = Literal["auto", "torch", "fla"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "fla")


@functools.cache
def fla_installed() -> bool:
    """``fla`` (flash-linear-attention) can be imported (checked once, without importing triton)."""
    return importlib.util.find_spec("fla") is not None


def gdn_backend(requested: str, device: torch.device) -> str:
    """The kernel a GDN call on ``device`` runs: ``"fla"`` or ``"torch"``.

    Raises:
        ValueError: ``requested`` is not one of ``BACKENDS``, or is ``"fla"`` where fla cannot run.
    """
    if requested not in BACKENDS:
        raise ValueError(f"gdn backend {requested!r}; accepted: {list(BACKENDS)}")
    if requested == "torch":
        return "torch"
    usable = fla_installed() and device.type == "cuda"
    if requested == "fla" and not usable:
        raise ValueError("gdn backend 'fla' needs the flash-linear-attention package and CUDA tensors "
                         f"(installed: {fla_installed()}, device: {device.type}); use 'auto' or 'torch'")
    return "fla" if usable else "torch"


def _fla_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               bounds: Sequence[int]) -> torch.Tensor:
    """fla's varlen chunked kernel on one packed row: same arguments and result as the torch path."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    # zero-length entries dropped (fla wants strictly increasing bounds); the host copy spares a sync
    host = torch.tensor(sorted(set(int(b) for b in bounds)), dtype=torch.long)
    o, _ = chunk_gated_delta_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.float().unsqueeze(0),
                                  beta=beta.unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=None,
                                  output_final_state=False, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=host.to(q.device), cu_seqlens_cpu=host)
    return o[0]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, bounds: Sequence[int], *, backend: str = "auto",
                           chunk_size: int = 64) -> torch.Tensor:
    """Packed gated delta rule (q/k L2-normalised and scaled inside) with the chosen kernel.

    Args: as :func:`~megatron_maspo.model.gdn_ops.packed_chunk_gated_delta_rule` (``[T, H, d]``
    tensors, host ``bounds``). Returns ``o [T, H, d_v]`` in v's dtype.
    """
    if gdn_backend(backend, q.device) == "fla":
        return _fla_chunk(q, k, v, g, beta, bounds)
    return packed_chunk_gated_delta_rule(q, k, v, g, beta, bounds, chunk_size=chunk_size)[0]
