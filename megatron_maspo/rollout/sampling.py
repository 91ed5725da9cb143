"""Pure sampling maths shared by the built-in engine and its tests.

Sampling is inverse-CDF with one seeded uniform per row and token (:func:`sample_tokens`).

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
    """Draw one token per row by inverse-CDF sampling with one uniform from each row's generator.

    One generator per row (seeded per prompt and sample index) makes a row's draw depend only on its
    own generator and logits, so the same seed reproduces the same completion regardless of batching.
    A row costs one fp32 ``exp``, one fp64 prefix sum and one binary search over the vocabulary, and a
    single random number: no per-token full-vocabulary noise (Gumbel-max would draw ``V`` variates
    and take ``V`` logs per row per token).

    Args:
        logprobs: [B, V] fp32 from :func:`scaled_logprobs`.
        top_p: nucleus mass in (0, 1]; tokens outside the nucleus get probability 0 and the kept mass
            is renormalised (the draw is scaled by the row's total).
        greedy: take the argmax instead of sampling.
        generators: B CPU generators (ignored when ``greedy``).

    Returns:
        [B] int64 token ids (on ``logprobs.device``).
    """
    if greedy:
        return logprobs.argmax(dim=-1)
    if len(generators) != logprobs.shape[0]:
        raise ValueError(f"sample_tokens: {len(generators)} generators for {logprobs.shape[0]} rows")
    probs = logprobs.exp()
    if top_p < 1.0:
        probs = probs.masked_fill(~top_p_mask(logprobs, top_p), 0.0)
    # fp64 prefix sums: the CDF of a 50k-150k vocabulary keeps ~1e-12 relative accuracy.
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    # x < total strictly, so the first index with cdf > x exists and has probability > 0.
    x = torch.minimum(u.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def batch_seed(seed: int, first_prompt: int) -> int:
    """The seed of one engine's ``generate`` call (vLLM): a 63-bit mix of the round's seed and the global
    index of the call's first prompt, so every engine of a step, and every step and round, starts its own
    random stream (the shards of one step have distinct first prompts). Deterministic: a rerun, or a
    resumed run, repeats it."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (first_prompt & _MASK64)) >> 1
