"""Gated DeltaNet maths in pure PyTorch, exact on packed rows (no state crosses a sequence boundary).

The gated delta rule (Yang et al., "Gated Delta Networks", 2024) keeps per head a state
``S ∈ R^{d_k×d_v}`` and, for token ``t`` with key ``k_t`` (L2-normalised), value ``v_t``, query
``q_t`` (L2-normalised, scaled by ``d_k^-1/2``), log-decay ``g_t ≤ 0`` and write strength
``β_t ∈ (0, 1)``::

    S_t = e^{g_t} S_{t-1} + k_t δ_tᵀ,   δ_t = β_t (v_t − e^{g_t} S_{t-1}ᵀ k_t),   o_t = S_tᵀ q_t.

:func:`recurrent_gated_delta_rule` is that loop, one token at a time (decode, and the reference the
tests hold the chunked form to). :func:`packed_chunk_gated_delta_rule` is the chunked form for
training: inside a chunk of ``C`` tokens with cumulative log-decay ``Γ_i = Σ_{j≤i} g_j`` and chunk
start state ``S_0``, unrolling the recursion gives

    (I + A) Δ = βV − diag(β e^{Γ}) K S_0,   A_ij = β_i e^{Γ_i−Γ_j} k_i·k_j  (j < i),

so ``Δ = U − W S_0`` with ``U = (I+A)^{-1} βV`` and ``W = (I+A)^{-1} diag(β e^Γ) K`` (one unit
lower-triangular solve per chunk, independent of ``S_0``, all chunks at once), then

    O = diag(e^Γ) Q S_0 + (QKᵀ ⊙ M) Δ,   M_ij = e^{Γ_i−Γ_j} (j ≤ i),
    S_C = e^{Γ_C} S_0 + (diag(e^{Γ_C−Γ}) K)ᵀ Δ,

a short sequential scan over chunks. Packing: each sequence is zero-padded to a multiple of ``C``
(pad tokens have ``k = v = β = g = 0``: they neither read nor change the state), so no chunk spans
two sequences, and the scan restarts from the sequence's initial state (zero by default) at the
first chunk of every sequence. :func:`packed_causal_conv1d` is the depthwise causal convolution
with the same reset: a tap that would reach before its sequence's first token reads zero.

Everything runs in fp32 and is differentiable by autograd (the solve included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
"""ε of the q/k L2 normalisation ``x / sqrt(Σx² + ε)`` (what Qwen3.5's reference and fla use)."""


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_bounds(bounds: Sequence[int], total: int) -> list[int]:
    """``bounds`` as ints, checked to run from 0 to ``total`` without decreasing."""
    b = [int(x) for x in bounds]
    if len(b) < 2 or b[0] != 0 or b[-1] != total or any(y < x for x, y in zip(b[:-1], b[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to the packed length {total} without "
                         f"decreasing, got {b[:8]}{'...' if len(b) > 8 else ''}")
    return b


def positions_in_sequence(bounds: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``[T]`` int64: each packed token's index inside its own sequence."""
    lens = torch.tensor([y - x for x, y in zip(bounds[:-1], bounds[1:])], device=device)
    starts = torch.tensor(list(bounds[:-1]), device=device)
    return torch.arange(bounds[-1], device=device) - torch.repeat_interleave(starts, lens)


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """Depthwise causal convolution per packed sequence, SiLU applied.

    Args:
        x: ``[T, C]`` packed channels.
        weight: ``[C, K]`` taps; ``weight[:, K-1]`` multiplies the current token.
        bounds: cu_seqlens ``[0, ..., T]`` (host ints).

    Returns:
        ``[T, C]``: ``silu(Σ_s weight[:, K-1-s] · x[t-s])`` over the taps ``s`` with ``t-s`` in
        ``t``'s own sequence (no conv state leaks between sequences).
    """
    t, k = x.shape[0], weight.shape[1]
    pos = positions_in_sequence(check_bounds(bounds, t), x.device)
    y = x * weight[:, k - 1]
    for s in range(1, k):
        shifted = F.pad(x, (0, 0, s, 0))[:t] * (pos >= s).unsqueeze(1).to(x.dtype)
        y = y + shifted * weight[:, k - 1 - s]
    return F.silu(y)


def _prepare(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None, *,
                               use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (decode; the chunked form's reference).

    Args:
        q, k: ``[B, L, H, d_k]`` (k heads already repeated to the value heads).
        v: ``[B, L, H, d_v]``.
        g, beta: ``[B, L, H]`` log-decay (≤ 0) and write strength.
        initial_state: ``[B, H, d_k, d_v]`` or None (zeros).

    Returns:
        ``(o [B, L, H, d_v] in v's dtype, final state [B, H, d_k, d_v] fp32)``.
    """
    q, k = _prepare(q, k, use_qk_l2norm)
    vf, g, beta = v.float(), g.float(), beta.float()
    b, n, h, dk = k.shape
    s = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
         if initial_state is None else initial_state.float())
    outs = []
    for i in range(n):
        s = s * g[:, i].exp()[..., None, None]
        read = torch.einsum("bhkv,bhk->bhv", s, k[:, i])
        delta = (vf[:, i] - read) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
    return torch.stack(outs, dim=1).to(v.dtype), s


def _pad_to_chunks(x: torch.Tensor, bounds: list[int], chunk: int) -> torch.Tensor:
    """``[T, ...]`` → ``[T_pad, ...]``: every sequence zero-padded at its end to a multiple of ``chunk``."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            pad = (-(b - a)) % chunk
            parts.append(F.pad(x[a:b], (0, 0) * (x.dim() - 1) + (0, pad)))
    return torch.cat(parts, dim=0)


def _unpad(x: torch.Tensor, bounds: list[int], chunk: int) -> torch.Tensor:
    parts, off = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            parts.append(x[off:off + b - a])
            off += b - a + (-(b - a)) % chunk
    return torch.cat(parts, dim=0)


def packed_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, bounds: Sequence[int], *, chunk_size: int = 64,
                                  initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over packed sequences (training form, see the module docstring).

    Args:
        q, k: ``[T, H, d_k]`` packed (k heads already repeated to the value heads).
        v: ``[T, H, d_v]``.
        g, beta: ``[T, H]``.
        bounds: cu_seqlens ``[0, ..., T]`` (host ints); zero-length entries are allowed.
        chunk_size: ``C``; any positive value gives the same result up to rounding.
        initial_state: ``[N, H, d_k, d_v]`` per non-empty sequence, or None (zeros).

    Returns:
        ``(o [T, H, d_v] in v's dtype, final states [N, H, d_k, d_v] fp32)``, N = non-empty sequences.
    """
    bounds = check_bounds(bounds, q.shape[0])
    c = chunk_size
    q, k = _prepare(q, k, use_qk_l2norm)
    qp, kp, vp = (_pad_to_chunks(x, bounds, c) for x in (q, k, v.float()))
    gp, bp = (_pad_to_chunks(x.float().unsqueeze(-1), bounds, c).squeeze(-1) for x in (g, beta))
    h = qp.shape[1]
    # [T_pad, H, d] -> [H, n, C, d]; [T_pad, H] -> [H, n, C]
    qc, kc, vc = (x.transpose(0, 1).reshape(h, -1, c, x.shape[-1]) for x in (qp, kp, vp))
    gc, bc = (x.transpose(0, 1).reshape(h, -1, c) for x in (gp, bp))
    gam = gc.cumsum(-1)                                           # Γ [H, n, C]
    diff = gam.unsqueeze(-1) - gam.unsqueeze(-2)                  # Γ_i − Γ_j [H, n, C, C]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~incl, float("-inf")).exp()           # M (j ≤ i), 0 above; no overflow
    strict = torch.eye(c, dtype=torch.bool, device=q.device) | ~incl
    kb = kc * bc.unsqueeze(-1)
    a = ((kb @ kc.transpose(-1, -2)) * decay).masked_fill(strict, 0.0)
    lhs = a + torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([vc * bc.unsqueeze(-1), kb * gam.exp().unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    u, w = sol.split([vc.shape[-1], kc.shape[-1]], dim=-1)        # U [H,n,C,d_v], W [H,n,C,d_k]
    attn = (qc @ kc.transpose(-1, -2)) * decay                    # (QKᵀ ⊙ M) [H, n, C, C]
    q_read = qc * gam.exp().unsqueeze(-1)
    k_write = kc * (gam[..., -1:] - gam).exp().unsqueeze(-1)
    chunk_decay = gam[..., -1].exp()                              # [H, n]

    # first chunk of each sequence, and its last chunk (where the final state is read)
    first, last, n_chunks = [], [], 0
    for x, y in zip(bounds[:-1], bounds[1:]):
        if y > x:
            first.append(n_chunks)
            n_chunks += -(-(y - x) // c)
            last.append(n_chunks - 1)
    dk, dv = kc.shape[-1], vc.shape[-1]
    starts = dict(zip(first, range(len(first))))
    outs, finals = [], []
    s = q.new_zeros(h, dk, dv)
    for i in range(n_chunks):
        if i in starts:  # a new sequence: its own initial state, nothing carried over
            s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state[starts[i]].float()
        delta = u[:, i] - w[:, i] @ s
        outs.append(q_read[:, i] @ s + attn[:, i] @ delta)
        s = s * chunk_decay[:, i, None, None] + k_write[:, i].transpose(-1, -2) @ delta
        if i == last[len(finals)]:
            finals.append(s)
    o = torch.stack(outs, dim=1).reshape(h, -1, dv).transpose(0, 1)  # [T_pad, H, d_v]
    return _unpad(o, bounds, c).to(v.dtype), torch.stack(finals, dim=0)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w ⊙ x / rms(x) ⊙ silu(gate)`` over the last dim (fp32 inside; the GDN output norm, plain w)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y.to(x.dtype)).float().mul(F.silu(gate.float())).to(x.dtype)
