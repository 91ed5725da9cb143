"""Which gated-delta-rule kernel the trainer's Gated DeltaNet runs: ``fla`` (triton, GPU) or pure torch.

``fla`` (flash-linear-attention, installed by the ``gdn`` extra on GPU machines) has a varlen chunked
kernel with its own backward (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, fla-core 0.6: q/k
``[1, T, H, d_k]``, ``cu_seqlens`` ``[N+1]``, q/k L2 norm and the ``d_k^-1/2`` scale inside, as here);
it runs only on CUDA tensors. The pure-torch path
(:func:`megatron_maspo.model.gdn_ops.packed_chunk_gated_delta_rule`) runs anywhere and is the
reference. :func:`gdn_backend` picks: ``"auto"`` takes fla for CUDA inputs and torch for CPU ones;
``"torch"`` and ``"fla"`` force one (``"fla"`` without fla, or on CPU, is an error, never a silent
fallback). ``"auto"`` on CUDA without fla is an error too: the torch path is a Python loop over 64-token
chunks whose autograd keeps an fp32 ``[H, d_k, d_v]`` state per chunk (about 1 GB per layer at 32k
tokens, hundreds of launches per layer), a silent slowdown no GPU run should get by accident. Forcing it
there takes ``MASPO_GDN_BACKEND=torch`` (read where the backend is ``"auto"``). This module is the only
importer of ``fla``.

fla's keyword surface, read at its tags: ``cu_seqlens_cpu`` (the host copy of the bounds that spares a
device-to-host sync) exists from v0.4.2; v0.3.0-v0.3.2 take neither it nor ``**kwargs`` (TypeError),
v0.4.0-v0.4.1 swallow it. The ``gdn`` extra therefore starts at 0.4.2 and :func:`fla_accepts_host_bounds`
checks the installed kernel's signature before the first call.
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


ENV = "MASPO_GDN_BACKEND"
"""Environment override of an ``"auto"`` backend (``torch`` or ``fla``)."""


def gdn_backend(requested: str, device: torch.device) -> str:
    """The kernel a GDN call on ``device`` runs: ``"fla"`` or ``"torch"``.

    Raises:
        ValueError: ``requested`` is not one of ``BACKENDS``; ``"fla"`` where fla cannot run; ``"auto"`` on
            CUDA without fla (unless ``MASPO_GDN_BACKEND=torch``).
    """
    import os

    if requested not in BACKENDS:
        raise ValueError(f"gdn backend {requested!r}; accepted: {list(BACKENDS)}")
    if requested == "auto" and os.environ.get(ENV):
        requested = os.environ[ENV]
        if requested not in ("torch", "fla"):
            raise ValueError(f"{ENV}={requested!r}; accepted: 'torch', 'fla'")
    if requested == "torch":
        return "torch"
    usable = fla_installed() and device.type == "cuda"
    if requested == "fla" and not usable:
        raise ValueError("gdn backend 'fla' needs the flash-linear-attention package and CUDA tensors "
                         f"(installed: {fla_installed()}, device: {device.type}); use 'auto' or 'torch'")
    if device.type == "cuda" and not usable:
        raise ValueError("Gated DeltaNet on CUDA without flash-linear-attention: install the gdn extra "
                         "(flash-linear-attention>=0.4.2), or set MASPO_GDN_BACKEND=torch for the pure-torch "
                         "kernel (a Python chunk loop, about 1 GB of saved state per layer at 32k tokens)")
    return "fla" if usable else "torch"


@functools.cache
def fla_accepts_host_bounds() -> bool:
    """Whether the installed fla's ``chunk_gated_delta_rule`` names ``cu_seqlens_cpu`` (fla >= 0.4.2)."""
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return "cu_seqlens_cpu" in inspect.signature(chunk_gated_delta_rule).parameters


def _fla_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               bounds: Sequence[int]) -> torch.Tensor:
    """fla's varlen chunked kernel on one packed row: same arguments and result as the torch path."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if not fla_accepts_host_bounds():
        raise RuntimeError("the installed flash-linear-attention predates 0.4.2 (its chunk_gated_delta_rule "
                           "takes no cu_seqlens_cpu): install the gdn extra (flash-linear-attention>=0.4.2)")
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
