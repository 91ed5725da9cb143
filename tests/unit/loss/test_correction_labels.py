"""The rollout-correction defaults and conventions against what their sources do (issue 44), in float64:

- ``seq_mask``'s default band is verl's Geo-RS preset (``seq_mean_k1``, "0.999_1.001"), whose statistic is
  mean_t(−log k): a response verl keeps is kept here and one it rejects is rejected, at both edges;
- ``token_mask`` is token rejection (no IS weight): the kept tokens' gradient is plain PPO's;
- dropped tokens stay in the denominator: with token-mean, the gradient is N_kept/N times verl's, which
  divides by the kept tokens only;
- BAPO's ρ₀ default is the authors' stated 0.5.
The verl rules are written out here from its definitions (threshold parsing and k1 statistic), not
imported.
"""

from __future__ import annotations

import math

import torch

from megatron_maspo.loss import LossConfig, LossInputs, compute_policy_loss
from megatron_maspo.loss.params import BapoParams, RolloutCorrectionParams
from megatron_maspo.loss.rollout_correction import correction_factor

F64 = torch.float64


def _verl_geo_rs_keeps(log_k_mean: float, spec: str = "0.999_1.001") -> bool:
    """verl's seq_mean_k1 rule: "lower_upper" bounds mean_t(−log k) by [log lower, log upper]."""
    lower, upper = (float(x) for x in spec.split("_"))
    return math.log(lower) <= -log_k_mean <= math.log(upper)


def test_seq_mask_default_band_decides_like_verls_geo_rs_preset_at_both_edges():
    p = RolloutCorrectionParams(mode="seq_mask")
    lo, hi = p.band()
    assert (lo, hi) == (1 / 1.001, 1 / 0.999)
    # geometric means just inside and just outside each edge (the old default's low end 0.999 sat
    # 1e-6 below verl's 1/1.001, so a response at 0.9990005 was kept here and rejected by verl)
    for gm in (0.9990005, 1 / 1.001 * (1 + 1e-9), 1 / 1.001 * (1 - 1e-9), 1 / 0.999 * (1 - 1e-9),
               1 / 0.999 * (1 + 1e-9), 1.0):
        log_k = torch.full((4,), math.log(gm), dtype=F64)
        old = torch.zeros(4, dtype=F64)
        c, dropped = correction_factor(p, old, old - log_k, torch.ones(4, dtype=torch.bool),
                                       torch.zeros(4, dtype=torch.long))
        assert bool(dropped.any()) == (not _verl_geo_rs_keeps(math.log(gm))), gm


def test_token_mask_is_rejection_and_dropped_tokens_stay_in_the_denominator():
    g = torch.Generator().manual_seed(0)
    t = 12
    old = -torch.rand(t, generator=g, dtype=F64) - 0.1
    logp = old + 0.05 * torch.randn(t, generator=g, dtype=F64)
    adv = torch.randn(t, generator=g, dtype=F64)
    rollout = old + torch.tensor([0.0, 1.5, 0.0, -1.5, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, -2.0, 0.0], dtype=F64)
    mask = torch.ones(t, dtype=torch.bool)
    cfg = LossConfig(method="grpo", rollout_correction=RolloutCorrectionParams(mode="token_mask"))
    x = logp.clone().requires_grad_()
    loss, _ = compute_policy_loss(cfg, LossInputs(logprobs=x, old_logprobs=old, advantages=adv, mask=mask,
                                                  num_tokens_global=t, rollout_logprobs=rollout))
    (g_ours,) = torch.autograd.grad(loss, x)
    k = torch.exp(old - rollout)
    kept = (k >= 0.5) & (k <= 2.0)
    n_kept = int(kept.sum())
    assert 0 < n_kept < t  # non-vacuous: |log k| = 1.5 and 2 fall outside [0.5, 2]
    # verl's token rejection: plain PPO-clip on the kept tokens, no IS factor, token-mean over kept ones
    y = logp.clone().requires_grad_()
    ratio = torch.exp(y - old)
    surr = torch.maximum(-ratio * adv, -torch.clamp(ratio, 0.8, 1.2) * adv)
    surr = torch.where((adv < 0) & (ratio > 3.0), -3.0 * adv, surr)  # dual clip c = 3, as configured
    verl = (surr * kept).sum() / n_kept
    (g_verl,) = torch.autograd.grad(verl, y)
    torch.testing.assert_close(g_ours, g_verl * n_kept / t, rtol=0, atol=1e-12)
    assert torch.all(g_ours[~kept] == 0)


def test_bapo_default_target_share_is_the_authors_stated_value():
    assert BapoParams().target_share == 0.5
    assert (BapoParams().low_range, BapoParams().high_range) == ((0.6, 0.9), (1.2, 3.0))
