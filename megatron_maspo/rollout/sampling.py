"""Pure sampling maths shared by the built-in engine and its tests.

Log-prob convention (loss-formulas.md §0.3, weight-sync-notes.md §2): the returned log-prob of a token is
``log softmax(z / T)[token]`` over the **full** vocabulary, i.e. the temperature-scaled distribution the
trainer recomputes, *not* renormalised over the top-p nucleus. With ``top_p = 1`` (the RL default) it is
exactly the sampling distribution; with ``top_p < 1`` the sampling distribution is the nucleus-renormalised
one and ``log p_sample = log p_returned - log(kept mass)``.
"""

from __future__ import annotations

import torch


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32; ``T = 0`` (greedy) uses ``T = 1``.

    Args:
        logits: [B, V] any float dtype.
        temperature: T >= 0.

    Returns:
        [B, V] fp32 log-probs.
    """
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)


def top_p_mask(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean [B, V] mask of the smallest set of tokens whose mass reaches ``top_p`` (always >= 1 token).

    A token is kept when the mass strictly before it (in descending-probability order) is < ``top_p``.
    """
    if top_p >= 1.0:
        return torch.ones_like(logprobs, dtype=torch.bool)
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(logprobs: torch.Tensor, top_p: float, greedy: bool,
                  generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row with the Gumbel-max trick and one generator per row.

    One generator per row (seeded per prompt and sample index) makes a row's draws independent of what
    else is in the batch, so the same seed reproduces the same completion regardless of batching.

    Args:
        logprobs: [B, V] fp32 from :func:`scaled_logprobs`.
        top_p: nucleus mass in (0, 1].
        greedy: take the argmax instead of sampling.
        generators: B CPU generators (ignored when ``greedy``).

    Returns:
        [B] int64 token ids.
    """
    if greedy:
        return logprobs.argmax(dim=-1)
    masked = logprobs.masked_fill(~top_p_mask(logprobs, top_p), float("-inf"))
    b, v = logprobs.shape
    u = torch.stack([torch.rand(v, generator=g, dtype=torch.float64) for g in generators])
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (masked.double() + gumbel.to(masked.device)).argmax(dim=-1)
