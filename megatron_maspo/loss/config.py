"""`LossConfig`: every knob of the policy-loss family, with paper symbols and defaults.

All formulas and defaults follow docs/algorithms.md (shared spec); `docs/losses.md` summarises them.
Validation happens once, in `__post_init__`, so the maths code can trust its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

METHODS = ("grpo", "clip_higher", "dac", "bapo", "sapo", "cispo", "gppo", "maspo", "quatro")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ADVANTAGES = ("grpo", "drgrpo", "rloo")
KL_TYPES = ("k1", "k2", "k3")
NONFINITE = ("raise", "mask")
BAPO_CONTRIBUTIONS = ("loss_value", "gradient_mass")
BAPO_ORDERS = ("high_first", "low_first")
BAPO_SCOPES = ("mini_batch", "micro_batch")
QUATRO_DIVERGENCES = ("kl_new_old", "kl_old_new", "k3")
QUATRO_SOLVERS = ("fixed", "dual_ascent", "reps_closed_form")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """Configuration of the per-token policy loss, its regularisers, advantages and aggregation."""

    method: str = "maspo"
    """Surrogate, one of METHODS. 'quatro' is a reconstruction (algorithms.md §14)."""

    # --- PPO-style clipping (grpo, clip_higher, dac, cispo, gppo, quatro with keep_ratio_clip) ---
    eps_low: float = 0.2
    """ε_low: lower clip half-width, band [1-ε_low, 1+ε_high]. 0.2 (MASPO §5.1). For 'dac' it is the
    ε_low of L(p_old); for 'cispo' the IS-weight lower bound."""
    eps_high: float = 0.2
    """ε_high: upper clip half-width. 0.2 (GRPO); DAPO 0.28; MASPO's Clip-Higher baseline 0.265;
    DCPO scripts use 0.28 for 'dac'."""
    dual_clip_c: float | None = None
    """Dual-clip constant c for Â<0, ρ>c (constant loss -c·Â, w = 0) in the clip methods; verl uses 3,
    DCPO 10. None = off. MASPO ignores it (see maspo_safety_cap)."""

    # --- MASPO (arXiv 2602.17550 §4, App. A.3) ---
    sigma_base: float = 1.0
    """σ_base in the mass term m = min(σ_base / p_old^α, sigma_cap); 1.0 in the paper."""
    alpha: float = 0.3
    """Mass exponent α; paper 0.3 (7B), 0.5 (14B). 0 disables mass adaptation."""
    beta_high: float = 0.03
    """β_high: risk factor for Â>0, σ_pos = m·clip(1 + β_high·Â, risk_min, risk_max); paper 0.03."""
    beta_low: float = 0.03
    """β_low: risk factor for Â<0, σ_neg = m·clip(1 / (1 - β_low·Â), risk_min, risk_max); paper 0.03."""
    sigma_cap: float = 10.0
    """Absolute cap on the mass term m (reference code `maspo_sigma_high`); 10."""
    risk_min: float = 0.1
    """Lower clamp of the risk factor (reference code `maspo_adv_low`); 0.1."""
    risk_max: float = 10.0
    """Upper clamp of the risk factor (reference code `maspo_adv_high`); 10."""
    maspo_safety_cap: float | None = None
    """Optional cap for Â<0 with ρ > c: constant loss -c·Â, w = 0. Absent in the paper and the
    reference code (ungated negatives can carry weight up to e^20); None = off (fidelity)."""

    # --- SAPO (arXiv 2511.20347) ---
    tau_pos: float = 1.0
    """τ_pos: SAPO temperature for Â>0; 1.0."""
    tau_neg: float = 1.05
    """τ_neg: SAPO temperature for Â≤0; 1.05."""

    # --- DAC (DCPO, arXiv 2509.02333) ---
    dac_upper_cap: float = 10.0
    """Clamp on DAC's upper bound U(p_old) (DCPO code: max(clip_ratio_c, 10)); 10."""
    p_old_floor: float = 1e-12
    """Floor on p_old where a method divides by it (DAC bounds); 1e-12."""

    # --- BAPO (arXiv 2510.18927 Alg. 1, Eq. 8) ---
    bapo_target_share: float = 0.4
    """ρ₀: target share of positive-advantage contribution; paper 0.4 (README 0.5)."""
    bapo_low_range: tuple[float, float] = (0.6, 0.9)
    """(a⁻, b⁻): search range of the lower ratio bound c_low; paper (0.6, 0.9)."""
    bapo_high_range: tuple[float, float] = (1.2, 3.0)
    """(a⁺, b⁺): search range of the upper ratio bound c_high; paper (1.2, 3.0)."""
    bapo_step_low: float = 0.02
    """δ₂: c_low increment; paper 0.02."""
    bapo_step_high: float = 0.05
    """δ₁: c_high increment; paper 0.05."""
    bapo_contribution: str = "loss_value"
    """How negatives count in the share: 'loss_value' |Â|·max(ρ, c_low) (paper/code) or
    'gradient_mass' |Â|·ρ over ρ ≥ c_low only (algorithms.md §8 subtlety)."""
    bapo_order: str = "high_first"
    """Which bound moves first: 'high_first' (paper) or 'low_first' (official code)."""
    bapo_scope: str = "mini_batch"
    """Tokens the bound search sees: 'mini_batch' (Alg. 1: the whole optimizer step's batch at the
    current policy, all micro-batches and DP ranks; the trainer runs one forward-only pass per
    mini-batch after the first to get the current ratios) or 'micro_batch' (official code: each loss
    call, all-reduced over DP; no extra forward)."""

    # --- CISPO / GPPO ---
    gppo_beta_low: float = 1.0
    """β₁ of (CE-)GPPO for Â<0, ρ<1-ε_low; GPPO 1.0, CE-GPPO 0.75."""
    gppo_beta_high: float = 1.0
    """β₂ of (CE-)GPPO for Â>0, ρ>1+ε_high; 1.0."""

    # --- QUATRO reconstruction (arXiv 2602.04620; algorithms.md §14, all [inferred]) ---
    quatro_divergence: str = "kl_new_old"
    """Stabiliser D(ρ): 'kl_new_old' ρ·log ρ, 'kl_old_new' -log ρ, 'k3' ρ - 1 - log ρ."""
    quatro_delta: float = 0.01
    """δ_q: per-prompt trust-region radius (same for all prompts); unknown in the paper."""
    quatro_dual_solver: str = "fixed"
    """λ_q: 'fixed' (= quatro_lambda_init), 'dual_ascent' (one projected step from lambda_init on the
    batch's per-prompt divergence), 'reps_closed_form' (1-D REPS dual over the prompt's advantages)."""
    quatro_lambda_init: float = 0.1
    """Initial / fixed dual variable λ; unknown in the paper."""
    quatro_lambda_lr: float = 1.0
    """η_λ: dual-ascent step size."""
    quatro_lambda_min: float = 0.0
    """Lower clamp of λ_q (≥ 0, dual feasibility)."""
    quatro_lambda_max: float = 100.0
    """Upper clamp of λ_q (also the REPS search range top)."""
    quatro_drop_zero_mean_term: bool = False
    """Drop the zero-mean '+1' of ∇(ρ log ρ) (uses ρ log ρ - ρ + 1) to reduce variance."""
    quatro_keep_ratio_clip: bool = False
    """Keep PPO clipping (eps_low/eps_high) on the ρ·Â part."""

    # --- aggregation (algorithms.md §2) ---
    aggregation: str = "token-mean"
    """One of AGGREGATIONS; token-mean for MASPO/DAPO, seq-mean-token-mean for GRPO/SAPO."""
    norm_constant: float | None = None
    """C for 'seq-mean-token-sum-norm' (Dr.GRPO: e.g. the max response length); required there."""

    # --- regularisers and corrections ---
    entropy_coef: float = 0.0
    """c_H: entropy bonus, loss -= c_H·H_t (needs `entropy` with gradient); MASPO 0."""
    kl_coef: float = 0.0
    """β_KL on the KL to the reference policy; MASPO 0, DeepSeekMath 0.04."""
    kl_type: str = "k3"
    """KL estimator: 'k1' log π/π_ref, 'k2' ½(log π/π_ref)², 'k3' r - log r - 1 with r = π_ref/π."""
    tis_cap: float | None = None
    """Truncated IS against rollout log-probs: pg loss ×= min(π_old/π_rollout, tis_cap), detached.
    None = off. Composes with every method."""

    # --- advantage estimators (algorithms.md §1, §7, §12.2) ---
    advantage: str = "grpo"
    """Group estimator: 'grpo' (mean/std), 'drgrpo' (mean only), 'rloo' (leave-one-out)."""
    std_unbiased: bool = True
    """Bessel-corrected std for 'grpo' (verl, default); False = population std (MASPO App. B)."""
    eps_adv: float = 1e-6
    """ε_A added to the std; 1e-6 (verl)."""
    entropy_adv_coef: float = 0.0
    """α of Entropy Advantage, Â' = Â + min(α·sg[H], |Â|/κ); 0 = off, 0.4 with GRPO."""
    entropy_adv_kappa: float = 2.0
    """κ of Entropy Advantage; 2."""
    adv_reweight_alpha: float = 0.0
    """α_A of Advantage Reweighting, Â' = (α_A·p_old + 1 - α_A)·Â; 0 = off, MASPO's baseline 0.1."""

    # --- numerics ---
    log_ratio_clamp: float = 20.0
    """|log ρ| clamp before exp; 20 (verl)."""
    nonfinite: str = "raise"
    """Non-finite log-probs/advantages: 'raise' ValueError, or 'mask' them out and count them."""

    def __post_init__(self) -> None:
        choices = {"method": METHODS, "aggregation": AGGREGATIONS, "advantage": ADVANTAGES,
                   "kl_type": KL_TYPES, "nonfinite": NONFINITE, "bapo_contribution": BAPO_CONTRIBUTIONS,
                   "bapo_order": BAPO_ORDERS, "bapo_scope": BAPO_SCOPES, "quatro_divergence": QUATRO_DIVERGENCES,
                   "quatro_dual_solver": QUATRO_SOLVERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}; accepted: {allowed}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"LossConfig.{f.name}={v} must be finite")
        positive = ("sigma_base", "sigma_cap", "risk_min", "risk_max", "tau_pos", "tau_neg",
                    "dac_upper_cap", "p_old_floor", "bapo_step_low", "bapo_step_high",
                    "entropy_adv_kappa", "eps_adv", "log_ratio_clamp", "quatro_lambda_max")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)} must be > 0")
        non_negative = ("eps_low", "eps_high", "alpha", "beta_high", "beta_low", "entropy_coef",
                        "kl_coef", "entropy_adv_coef", "quatro_delta", "quatro_lambda_init",
                        "quatro_lambda_lr", "quatro_lambda_min", "gppo_beta_low", "gppo_beta_high")
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)} must be >= 0")
        if self.eps_low >= 1:
            raise ValueError(f"LossConfig.eps_low={self.eps_low} must be < 1 (band [1-eps_low, ...])")
        if self.risk_min > self.risk_max:
            raise ValueError(f"LossConfig.risk_min={self.risk_min} > risk_max={self.risk_max}")
        if self.quatro_lambda_min > self.quatro_lambda_max:
            raise ValueError(f"LossConfig.quatro_lambda_min={self.quatro_lambda_min} > "
                             f"quatro_lambda_max={self.quatro_lambda_max}")
        for name in ("dual_clip_c", "maspo_safety_cap"):
            c = getattr(self, name)
            if c is not None and not c > 1:
                raise ValueError(f"LossConfig.{name}={c} must be None or > 1")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"LossConfig.tis_cap={self.tis_cap} must be None or > 0")
        if not 0 <= self.adv_reweight_alpha <= 1:
            raise ValueError(f"LossConfig.adv_reweight_alpha={self.adv_reweight_alpha} not in [0, 1]")
        if not 0 < self.bapo_target_share < 1:
            raise ValueError(f"LossConfig.bapo_target_share={self.bapo_target_share} not in (0, 1)")
        for name in ("bapo_low_range", "bapo_high_range"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"LossConfig.{name}={(lo, hi)} must satisfy 0 < lo <= hi")
        if self.aggregation == "seq-mean-token-sum-norm" and not (self.norm_constant or 0) > 0:
            raise ValueError("LossConfig.norm_constant must be > 0 for aggregation="
                             "'seq-mean-token-sum-norm' (Dr.GRPO's constant C)")
