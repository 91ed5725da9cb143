"""Per-token surrogates: autograd gradient == documented -sg[w]·ρ·Â oracle, gradcheck, limits,
and the hand-computed vectors of loss-formulas.md (§6 DAC, §9 SAPO, §13.5 MASPO)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.loss import LossConfig, token_losses
from megatron_maspo.loss.maspo import maspo_gate, maspo_sigmas
from megatron_maspo.loss.params import MaspoParams
from megatron_maspo.loss.ppo import dac_bounds
from megatron_maspo.loss.sapo import sapo_weight

T = 64
F64 = torch.float64


def _inputs(seed: int = 0, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(T, generator=g, dtype=F64) * 6 - 0.01           # p_old in (2.5e-3, 0.99)
    logp = old + spread * torch.randn(T, generator=g, dtype=F64)         # ρ spread over both sides
    adv = torch.randn(T, generator=g, dtype=F64) * 1.5
    return logp.requires_grad_(), old, adv


def _ppo_w(r, a, lo, hi, c=None):
    w = torch.where(a > 0, (r <= hi).to(F64), torch.where(a < 0, (r >= lo).to(F64), torch.ones_like(r)))
    if c is not None:
        w = torch.where((a < 0) & (r > c), 0.0, w)
    return w


def _oracle(method: str, r, old, a, **p):
    """Independent re-statement of loss-formulas.md §15's w column."""
    el, eh = p.get("eps_low", 0.2), p.get("eps_high", 0.265 if method == "clip_higher" else 0.2)
    if method in ("grpo", "clip_higher"):  # verl's dual-clip c = 3 is on by default
        return _ppo_w(r, a, 1 - el, 1 + eh, p.get("dual_clip_c", 3.0))
    if method == "dac":
        pold = old.exp()
        lo = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * el / pold, min=0))
        hi = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * eh / pold), max=10.0)
        return _ppo_w(r, a, lo, hi, p.get("dual_clip_c", 3.0))
    if method == "cispo":  # MiniMax-M1 §3.1: no lower bound unless eps_low is given
        lo = None if p.get("eps_low") is None else 1 - p["eps_low"]
        return r.clamp(min=lo, max=1 + eh) / r
    if method == "gppo":
        b1, b2 = p.get("beta_low", 1.0), p.get("beta_high", 1.0)
        w = torch.ones_like(r)
        w = torch.where((a < 0) & (r < 1 - el), b1 * (1 - el) / r, w)
        return torch.where((a > 0) & (r > 1 + eh), b2 * (1 + eh) / r, w)
    if method == "sapo":
        # float64 τ (a torch.where on Python floats would build float32 τ: 1.0499999523)
        tau = torch.where(a > 0, torch.tensor(p.get("tau_pos", 1.0), dtype=F64),
                          torch.tensor(p.get("tau_neg", 1.05), dtype=F64))
        return 1.0 / torch.cosh(tau * (r - 1) / 2) ** 2
    if method == "maspo":
        sb, al, bh, bl = (p.get(k, d) for k, d in (("sigma_base", 1.0), ("alpha", 0.3),
                                                   ("beta_high", 0.03), ("beta_low", 0.03)))
        mass = torch.clamp(sb / old.exp() ** al, max=10.0)
        sp = mass * torch.clamp(1 + bh * a, 0.1, 10)
        sn = mass * torch.clamp(1 / (1 - bl * a), 0.1, 10)
        w = torch.ones_like(r)
        w = torch.where((a > 0) & (r > 1), torch.exp(-(r - 1) ** 2 / (2 * sp**2)), w)
        return torch.where((a < 0) & (r < 1), torch.exp(-(r - 1) ** 2 / (2 * sn**2)), w)
    raise AssertionError(method)


ORACLE_CASES = [
    ("grpo", {}), ("grpo", {"dual_clip_c": None}), ("clip_higher", {}),
    ("clip_higher", {"eps_low": 0.2, "eps_high": 0.28}), ("dac", {"eps_low": 0.2, "eps_high": 0.28}),
    ("dac", {"dual_clip_c": 10.0}), ("cispo", {"eps_low": 0.5, "eps_high": 0.3}),
    ("gppo", {}), ("gppo", {"beta_low": 0.75}), ("sapo", {}), ("maspo", {}),
    ("maspo", {"alpha": 0.5, "sigma_base": 0.5, "beta_high": 0.2, "beta_low": 0.1}),
]


@pytest.mark.parametrize("method,params", ORACLE_CASES)
def test_gradient_matches_weight_oracle(method, params):
    for seed in range(3):
        logp, old, adv = _inputs(seed, spread=1.2 if method == "maspo" else 0.6)
        (g,) = torch.autograd.grad(token_losses(method, logp, old, adv, params).sum(), logp)
        r = (logp.detach() - old).exp()
        w = _oracle(method, r, old, adv, **params)
        torch.testing.assert_close(g, -w * r * adv, rtol=1e-12, atol=1e-12)
        # Non-vacuous: the gate is active somewhere (except where the method cannot gate).
        if method != "cispo" or params:
            assert (w < 1 - 1e-9).any() or method == "sapo"


def test_quatro_gradient_matches_reconstruction():
    logp, old, adv = _inputs(1, spread=0.3)
    r = (logp.detach() - old).exp()
    lam = 0.3
    for div, extra in (("kl_new_old", lambda r: r * (1 + r.log())), ("kl_old_new", lambda r: -torch.ones_like(r)),
                       ("k3", lambda r: r - 1)):
        loss = token_losses("quatro", logp, old, adv,
                            {"divergence": div, "lambda_init": lam, "dual_solver": "fixed"})
        (g,) = torch.autograd.grad(loss.sum(), logp)
        torch.testing.assert_close(g, -(r * adv - lam * extra(r)), rtol=1e-12, atol=1e-12)
    loss = token_losses("quatro", logp, old, adv,
                        {"drop_zero_mean_term": True, "lambda_init": lam, "dual_solver": "fixed"})
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, -(r * adv - lam * r * r.log()), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["grpo", "clip_higher", "dac", "bapo", "sapo", "quatro"])
def test_gradcheck(method):
    """Surrogates without a stop-gradient on π_θ: the loss is its own objective."""
    logp, old, adv = _inputs(5)
    logp = logp[:16].detach().requires_grad_()
    kw = {"dual_solver": "fixed"} if method == "quatro" else {}  # the default REPS dual needs prompt ids
    assert torch.autograd.gradcheck(lambda x: token_losses(method, x, old[:16], adv[:16], kw), (logp,))


@pytest.mark.parametrize("method", ["maspo", "cispo", "gppo"])
def test_frozen_gate_finite_differences(method):
    """sg[·]-gated surrogates: gradcheck of the loss with its detached factor frozen at x0.

    (Plain gradcheck cannot pass here by design: the forward value varies through sg[ρ].)"""
    logp, old, adv = _inputs(6, spread=1.2)
    x0 = logp[:16].detach()
    old, adv = old[:16], adv[:16]
    frozen = {}

    def loss_with_frozen_factor(x):
        # Re-evaluate the method at x, but substitute the detached factor computed at x0.
        lr = torch.clamp(x - old, -20, 20)
        if method == "cispo":
            return -frozen["c"] * adv * x
        return -frozen["w"] * torch.exp(lr) * adv

    r0 = (x0 - old).exp()
    frozen["c"] = r0.clamp(max=1.2)  # CISPO's default: no lower bound (MiniMax-M1 §3.1)
    frozen["w"] = _oracle(method, r0, old, adv)
    jac = torch.autograd.functional.jacobian(lambda x: token_losses(method, x, old, adv), x0)
    x = x0.clone().requires_grad_()
    assert torch.autograd.gradcheck(loss_with_frozen_factor, (x,))
    h = 1e-6
    num = torch.stack([(loss_with_frozen_factor(x0 + h * e) - loss_with_frozen_factor(x0 - h * e)) / (2 * h)
                       for e in torch.eye(16, dtype=F64)], dim=1)
    torch.testing.assert_close(jac, num, rtol=1e-6, atol=1e-8)


def test_maspo_limits():
    logp, old, adv = _inputs(2, spread=1.5)
    r = (logp.detach() - old).exp()
    # σ_base huge (and cap lifted): vanilla policy gradient, w = 1.
    loss = token_losses("maspo", logp, old, adv, {"sigma_base": 1e8, "sigma_cap": 1e9})
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g, -r * adv, rtol=1e-9, atol=1e-12)
    # ρ ≡ 1 (first mini-batch): vanilla PG, loss = -Â.
    x = old.clone().requires_grad_()
    loss = token_losses("maspo", x, old, adv)
    torch.testing.assert_close(loss, -adv)
    (g,) = torch.autograd.grad(loss.sum(), x)
    torch.testing.assert_close(g, -adv)
    # Unilateral: gate is 1 on the non-gated side, < 1 on the gated side.
    cfg = LossConfig()
    _, sp, sn, _ = maspo_sigmas(old, adv, cfg)
    gate = maspo_gate(r, adv, sp, sn)
    ungated = ((adv > 0) & (r <= 1)) | ((adv < 0) & (r >= 1)) | (adv == 0)
    assert ungated.any() and (~ungated).any()
    assert torch.all(gate[ungated] == 1) and torch.all(gate[~ungated] < 1)
    # α = β = 0: constant-σ unilateral gate with σ = σ_base.
    sb = 0.7
    loss = token_losses("maspo", logp, old, adv,
                        {"sigma_base": sb, "alpha": 0.0, "beta_high": 0.0, "beta_low": 0.0})
    (g,) = torch.autograd.grad(loss.sum(), logp)
    w = torch.where(ungated, 1.0, torch.exp(-(r - 1) ** 2 / (2 * sb**2)))
    torch.testing.assert_close(g, -w * r * adv)


def test_maspo_safety_cap_off_by_default():
    old = torch.full((2,), -2.0, dtype=F64)
    logp = (old + math.log(5.0)).requires_grad_()          # ρ = 5, Â < 0: ungated by the paper
    adv = torch.tensor([-1.0, -2.0], dtype=F64)
    (g,) = torch.autograd.grad(token_losses("maspo", logp, old, adv).sum(), logp)
    torch.testing.assert_close(g, -5.0 * adv)
    loss = token_losses("maspo", logp, old, adv, {"safety_cap": 3.0})
    torch.testing.assert_close(loss, 3.0 * -adv)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.all(g == 0)


def test_equal_reward_groups_give_zero_gradient():
    from megatron_maspo.loss import compute_advantages

    adv_P_G = compute_advantages(LossConfig(), torch.tensor([[1.0] * 8, [-1.0] * 8], dtype=F64))
    adv = adv_P_G.reshape(-1).repeat_interleave(4)  # 4 tokens per response
    logp, old, _ = _inputs(3)
    logp = logp[: adv.numel()].detach().requires_grad_()
    for method in ("grpo", "dac", "bapo", "sapo", "cispo", "gppo", "maspo", "clip_higher"):
        (g,) = torch.autograd.grad(token_losses(method, logp, old[: adv.numel()], adv).sum(), logp)
        assert torch.all(g == 0), method


MASPO_VECTORS = [  # (ρ, p_old, Â, σ used, F) from loss-formulas.md §13.5, α = 0.3
    (1.5, 0.5, 1.0, 1.26808, 0.925209), (3.0, 0.01, 1.0, 4.10050, 0.887854),
    (1.1, 0.9, 2.0, 1.09404, 0.995831), (5.0, 1e-4, 0.5, 10.1500, 0.925286),
    (0.5, 0.5, -1.0, 1.19529, 0.916227), (0.2, 0.9, -3.0, 0.94689, 0.699841),
    (0.05, 0.99, -0.5, 0.98820, 0.629963), (0.5, 0.5, 1.0, None, 1.0), (2.0, 0.5, -1.0, None, 1.0),
]


@pytest.mark.parametrize("alpha,vectors", [
    (0.3, MASPO_VECTORS),
    (0.5, [(1.5, 0.5, 1.0, 1.45664, 0.942790), (3.0, 0.01, 1.0, 10.3, 0.981325),
           (0.5, 0.5, -1.0, 1.37302, 0.935844)]),
])
def test_maspo_vectors(alpha, vectors):
    r = torch.tensor([v[0] for v in vectors], dtype=F64)
    old = torch.tensor([v[1] for v in vectors], dtype=F64).log()
    adv = torch.tensor([v[2] for v in vectors], dtype=F64)
    cfg = LossConfig(maspo=MaspoParams(alpha=alpha))
    _, sp, sn, _ = maspo_sigmas(old, adv, cfg)
    gate = maspo_gate(r, adv, sp, sn)
    for i, (_, _, a, sigma, f) in enumerate(vectors):
        assert gate[i].item() == pytest.approx(f, abs=2e-6)
        if sigma is not None:
            assert (sp if a > 0 else sn)[i].item() == pytest.approx(sigma, abs=2e-5)
    # The same F through the loss's gradient.
    logp = (old + r.log()).requires_grad_()
    (g,) = torch.autograd.grad(token_losses("maspo", logp, old, adv, {"alpha": alpha}).sum(), logp)
    torch.testing.assert_close(g, -gate * r * adv)


def test_sapo_vectors():
    r = torch.tensor([0.5, 1.2, 1.5, 2.0, 3.0], dtype=F64)
    torch.testing.assert_close(sapo_weight(r, 1.0), torch.tensor([0.9400, 0.9901, 0.9400, 0.7864, 0.4200],
                                                                 dtype=F64), atol=6e-5, rtol=0)
    torch.testing.assert_close(sapo_weight(r, 1.05), torch.tensor([0.9341, 0.9891, 0.9341, 0.7681, 0.3888],
                                                                  dtype=F64), atol=6e-5, rtol=0)


def test_dac_vectors():
    p = torch.tensor([0.9, 0.5, 0.1, 0.01, 1e-4], dtype=F64)
    lo, hi = dac_bounds(p.log(), 0.2, 0.28, 10.0, 1e-12)
    torch.testing.assert_close(lo, torch.tensor([0.6667, 0.5, 0.5, 0.5, 0.5], dtype=F64), atol=6e-5, rtol=0)
    torch.testing.assert_close(hi, torch.tensor([1.2491, 1.4, 2.2464, 5.8151, 10.0], dtype=F64),
                               atol=6e-5, rtol=0)
    _, hi20 = dac_bounds(p.log(), 0.2, 0.20, 10.0, 1e-12)
    torch.testing.assert_close(hi20, torch.tensor([1.1872, 1.3062, 2.0, 5.0, 10.0], dtype=F64),
                               atol=6e-5, rtol=0)
    lo16, _ = dac_bounds(p.log(), 0.16, 0.2, 10.0, 1e-12)
    assert lo16[0].item() == pytest.approx(0.7687, abs=6e-5)
    # p_old = 0 (log -inf) stays finite thanks to the floor and the cap.
    lo0, hi0 = dac_bounds(torch.tensor([-math.inf], dtype=F64), 0.2, 0.28, 10.0, 1e-12)
    assert lo0.item() == 0.5 and hi0.item() == 10.0
