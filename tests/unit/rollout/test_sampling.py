"""Seeded inverse-CDF sampling: the empirical distribution matches softmax(z / T) (chi-square, fixed
seeds), top-p renormalises over the nucleus, impossible tokens are never drawn, and a row's draw does not
depend on the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.rollout.sampling import sample_tokens, scaled_logprobs, top_p_mask

# Upper 0.1% point of the chi-square distribution with 15 degrees of freedom (statistical tables).
CHI2_15_P001 = 37.70
V = 16


def _logits() -> torch.Tensor:
    return torch.linspace(-2.0, 2.5, V) + 0.3 * torch.sin(torch.arange(V, dtype=torch.float32))


def _draw(lp_row: torch.Tensor, top_p: float, rows: int = 2000, calls: int = 10) -> torch.Tensor:
    """[V] counts of rows * calls draws, each row with its own seeded generator (as the engine does)."""
    gens = [torch.Generator().manual_seed(10_000 + r) for r in range(rows)]
    lp = lp_row.expand(rows, -1).contiguous()
    toks = torch.cat([sample_tokens(lp, top_p, False, gens) for _ in range(calls)])
    return torch.bincount(toks, minlength=V).double()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def test_samples_follow_the_temperature_scaled_softmax():
    lp = scaled_logprobs(_logits()[None], 0.8)[0]
    counts = _draw(lp, 1.0)
    stat = _chi2(counts, lp.double().exp())
    assert stat < CHI2_15_P001, f"chi-square {stat:.1f} with 15 dof"
    # the test has power: it rejects the same counts against a nearby wrong temperature
    wrong = scaled_logprobs(_logits()[None], 1.0)[0].double().exp()
    assert _chi2(counts, wrong) > 3 * CHI2_15_P001


def test_top_p_renormalises_over_the_nucleus():
    lp = scaled_logprobs(_logits()[None], 1.0)[0]
    keep = top_p_mask(lp[None], 0.8)[0]
    assert 2 < int(keep.sum()) < V
    counts = _draw(lp, 0.8)
    assert counts[~keep].sum() == 0
    nucleus = lp.double().exp() * keep
    stat = _chi2(counts, nucleus / nucleus.sum())
    # dof = kept tokens - 1 <= 15: the 15-dof threshold is conservative for fewer categories
    assert stat < CHI2_15_P001, f"chi-square {stat:.1f}"


def test_impossible_tokens_are_never_drawn_and_greedy_is_argmax():
    z = _logits().clone()
    z[::2] = float("-inf")  # half the vocabulary impossible, including the first and last tokens
    z[-1] = float("-inf")
    lp = scaled_logprobs(z[None], 1.0)[0]
    counts = _draw(lp, 1.0, rows=500, calls=4)
    assert counts[torch.isinf(lp)].sum() == 0
    assert sample_tokens(lp[None], 1.0, True, []).item() == int(lp.argmax())


def test_a_rows_draw_is_independent_of_the_batch():
    lps = scaled_logprobs(torch.randn(6, 300, generator=torch.Generator().manual_seed(0)), 1.0)
    batch = sample_tokens(lps, 1.0, False, [torch.Generator().manual_seed(s) for s in range(6)])
    alone = [sample_tokens(lps[r:r + 1], 1.0, False, [torch.Generator().manual_seed(r)]).item()
             for r in range(6)]
    assert batch.tolist() == alone


def test_generator_count_must_match_rows():
    lp = scaled_logprobs(torch.zeros(3, 5), 1.0)
    with pytest.raises(ValueError, match="1 generators for 3 rows"):
        sample_tokens(lp, 1.0, False, [torch.Generator()])
