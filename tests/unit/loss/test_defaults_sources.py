"""Defaults that must match their stated source (issue 34, defects 1, 2, 3, 8); each test fails on the
code before the fix."""

from __future__ import annotations

import torch

from megatron_maspo.loss import LossConfig, LossInputs, compute_policy_loss, token_losses
from megatron_maspo.loss.bapo import bapo_search_bounds
from megatron_maspo.loss.params import BapoParams

F64 = torch.float64


def test_cispo_default_is_unclipped_below():
    """MiniMax-M1 §3.1: no lower bound on the IS weight, so for ρ < 1 the gradient is -ρ·Â·∇log π
    (w = 1), never 0.8/ρ·ρ·Â as a lower clip at 0.8 would give."""
    old = torch.log(torch.full((6,), 0.5, dtype=F64))
    rho = torch.tensor([0.05, 0.3, 0.6, 0.79, 0.95, 1.1], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, -1.0], dtype=F64)
    logp = (old + rho.log()).requires_grad_()
    (g,) = torch.autograd.grad(token_losses("cispo", logp, old, adv).sum(), logp)
    torch.testing.assert_close(g, -rho * adv, rtol=1e-14, atol=1e-15)
    # above 1 + ε_high the weight is still capped
    logp2 = (old + torch.log(torch.full((6,), 2.0, dtype=F64))).requires_grad_()
    (g2,) = torch.autograd.grad(token_losses("cispo", logp2, old, adv).sum(), logp2)
    torch.testing.assert_close(g2, -1.2 * adv, rtol=1e-14, atol=1e-15)
    # an explicit eps_low still clips below
    (g3,) = torch.autograd.grad(token_losses("cispo", logp, old, adv, {"eps_low": 0.2}).sum(), logp)
    torch.testing.assert_close(g3[:3], -torch.clamp(rho[:3], min=0.8) * adv[:3], rtol=1e-14, atol=1e-15)


def _bapo_inputs():
    # 3 positive tokens (Â=1) at ρ=1.6, 5 negatives (Â=-1) at ρ=1: share at c_high=1.2 is
    # 3·1.2/(3·1.2+5) = 0.419; with low_range a single point only raising c_high can help.
    r = torch.tensor([1.6] * 3 + [1.0] * 5, dtype=F64)
    a = torch.tensor([1.0] * 3 + [-1.0] * 5, dtype=F64)
    return r, a, torch.ones(8, dtype=torch.bool)


def test_bapo_raises_c_high_when_low_range_is_a_point():
    r, a, m = _bapo_inputs()
    r = torch.tensor([1.6] * 3 + [1.0] * 6, dtype=F64)  # share 3·1.2/(3.6+6) = 0.375 < 0.4 at c_high 1.2
    a = torch.tensor([1.0] * 3 + [-1.0] * 6, dtype=F64)
    m = torch.ones(9, dtype=torch.bool)
    for order in ("high_first", "low_first"):
        cfg = LossConfig(method="bapo", bapo=BapoParams(low_range=(0.8, 0.8), order=order, target_share=0.4))
        c_low, c_high, share = bapo_search_bounds(r, a, m, cfg)
        assert c_low == 0.8 and c_high > 1.2 and share >= 0.4, (order, c_low, c_high, share)


def test_bapo_code_variant_targets_p_over_n():
    cfg = LossConfig(method="bapo_code")
    p = cfg.params
    assert (p.target_ratio, p.order, p.low_range, p.high_range, p.step_low) == (0.5, "low_first", (0.6, 0.8),
                                                                                 (1.2, 2.0), 0.05)
    assert abs(p.share_threshold - 1 / 3) < 1e-15
    r, a, m = _bapo_inputs()
    c_low, c_high, share = bapo_search_bounds(r, a, m, cfg)
    assert share >= 1 / 3 and c_high == 1.2  # share 0.419 already meets P/N ≥ 0.5: nothing raised


def test_quatro_default_is_query_adaptive():
    """Two prompts with different advantage spreads get different λ_q under the default solver."""
    cfg = LossConfig(method="quatro")
    assert cfg.quatro.dual_solver != "fixed"
    g = torch.Generator().manual_seed(0)
    seq = torch.repeat_interleave(torch.arange(8), 4)
    prompt = seq // 4
    adv = torch.tensor([2.0, -2.0, 1.5, -1.5, 0.1, -0.1, 0.05, -0.05], dtype=F64)[seq]
    old = -torch.rand(32, generator=g, dtype=F64)
    _, met = compute_policy_loss(cfg, LossInputs(
        logprobs=old + 0.01, old_logprobs=old, advantages=adv,
        mask=torch.ones(32, dtype=torch.bool), num_tokens_global=32, seq_ids=seq,
        prompt_ids=prompt))
    from megatron_maspo.loss.base import TokenContext
    from megatron_maspo.loss.quatro import _lambdas, quatro_divergence
    lam = _lambdas(cfg, quatro_divergence(torch.zeros(32, dtype=F64), "kl_new_old", False), adv,
                   TokenContext(mask=torch.ones(32, dtype=torch.bool), seq_ids=seq, prompt_ids=prompt))
    assert lam[0] != lam[-1]  # per-query duals differ
    assert torch.isfinite(met["quatro/lambda_mean"])


def test_sapo_tau_is_exact_in_float64():
    """τ_neg = 1.05 exactly in float64 (torch.where on Python floats gave 1.0499999523)."""
    logp = torch.tensor([0.3], dtype=F64, requires_grad=True)
    old, adv = torch.zeros(1, dtype=F64), torch.tensor([-1.0], dtype=F64)
    loss = token_losses("sapo", logp, old, adv)
    r = torch.exp(torch.tensor(0.3, dtype=F64))
    want = -(4 / 1.05) * torch.sigmoid(1.05 * (r - 1)) * -1.0
    assert abs(float(loss.detach()) - float(want)) < 1e-15
