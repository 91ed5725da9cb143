"""Per-method parameter groups of `LossConfig` (``loss.<method>.<field>``), each validated where defined.

Each surrogate reads only its own group (``cfg.params`` is the group of ``cfg.method``), so a method's
defaults are its own: ``clip_higher`` clips at 1 + 0.265 without touching ``grpo``'s 0.2. Defaults
cite their source; "verl default" marks a value the MASPO paper does not state but its baselines ran
with (verl's ``clip_ratio_c = 3`` dual-clip for the PPO-clip baselines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

VERL_DUAL_CLIP = 3.0
"""verl's ``clip_ratio_c``: Â<0 tokens with ρ > 3 get the constant loss -3·Â (w = 0)."""

BAPO_CONTRIBUTIONS = ("loss_value", "gradient_mass")
BAPO_ORDERS = ("high_first", "low_first")
BAPO_SCOPES = ("mini_batch", "micro_batch")
QUATRO_DIVERGENCES = ("kl_new_old", "kl_old_new", "k3")
QUATRO_SOLVERS = ("fixed", "dual_ascent", "reps_closed_form")


def check(obj: object, *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
          choices: dict[str, tuple[str, ...]] | None = None, caps: tuple[str, ...] = ()) -> None:
    """Shared validation: finite floats, signs, enumerations and optional caps (None or > 1)."""
    name = type(obj).__name__
    for f in fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name}.{f.name}={v} must be finite")
    for key, allowed in (choices or {}).items():
        if getattr(obj, key) not in allowed:
            raise ValueError(f"{name}.{key}={getattr(obj, key)!r}; accepted: {allowed}")
    for key in positive:
        if not getattr(obj, key) > 0:
            raise ValueError(f"{name}.{key}={getattr(obj, key)} must be > 0")
    for key in non_negative:
        if not getattr(obj, key) >= 0:
            raise ValueError(f"{name}.{key}={getattr(obj, key)} must be >= 0")
    for key in caps:
        c = getattr(obj, key)
        if c is not None and not c > 1:
            raise ValueError(f"{name}.{key}={c} must be None or > 1")
    if hasattr(obj, "eps_low") and obj.eps_low >= 1:
        raise ValueError(f"{name}.eps_low={obj.eps_low} must be < 1 (band [1-eps_low, ...])")


@dataclass(kw_only=True, slots=True)
class ClipParams:
    """PPO-clip band [1-ε_low, 1+ε_high] with an optional dual-clip (grpo, clip_higher)."""

    eps_low: float = 0.2
    """ε_low; 0.2 for every clip baseline (MASPO §5.1)."""
    eps_high: float = 0.2
    """ε_high; 0.2 (GRPO, MASPO §5.1). Clip-Higher's group defaults to 0.265 (MASPO App. D.1)."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c for Â<0, ρ>c (constant loss -c·Â, w = 0); 3 = verl's default, under which MASPO's
    baselines ran (DCPO uses 10). None = off."""

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_low", "eps_high"), caps=("dual_clip_c",))


@dataclass(kw_only=True, slots=True)
class DacParams:
    """DAC (DCPO, arXiv 2509.02333): bounds L(p_old), U(p_old) from ε_low, ε_high."""

    eps_low: float = 0.2
    """ε_low of L(p_old); 0.2 (MASPO §5.1 clip; DCPO scripts 0.2)."""
    eps_high: float = 0.2
    """ε_high of U(p_old); 0.2 (MASPO §5.1 clip; DCPO scripts 0.28)."""
    upper_cap: float = 10.0
    """Clamp on U(p_old) (DCPO code: max(clip_ratio_c, 10)); 10."""
    p_old_floor: float = 1e-12
    """Floor on p_old before dividing by it."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c (verl default 3; DCPO 10); None = off."""

    def __post_init__(self) -> None:
        check(self, positive=("upper_cap", "p_old_floor"), non_negative=("eps_low", "eps_high"),
              caps=("dual_clip_c",))


@dataclass(kw_only=True, slots=True)
class BapoParams:
    """BAPO (arXiv 2510.18927 Alg. 1, Eq. 8): PPO-clip with searched ratio bounds."""

    target_share: float = 0.4
    """ρ₀: target share of positive-advantage contribution; paper 0.4 (README 0.5)."""
    low_range: tuple[float, float] = (0.6, 0.9)
    """(a⁻, b⁻): search range of c_low; paper (0.6, 0.9)."""
    high_range: tuple[float, float] = (1.2, 3.0)
    """(a⁺, b⁺): search range of c_high; paper (1.2, 3.0)."""
    step_low: float = 0.02
    """δ₂: c_low increment; paper 0.02."""
    step_high: float = 0.05
    """δ₁: c_high increment; paper 0.05."""
    contribution: str = "loss_value"
    """Negatives count as 'loss_value' |Â|·max(ρ, c_low) (paper/code) or 'gradient_mass' |Â|·ρ over
    ρ ≥ c_low only."""
    order: str = "high_first"
    """'high_first' (paper) or 'low_first' (official code)."""
    scope: str = "mini_batch"
    """Tokens the search sees: 'mini_batch' (Alg. 1: the optimizer step's whole batch at the current
    policy, over all micro-batches and DP ranks; one extra forward-only pass per mini-batch after
    the first) or 'micro_batch' (official code: each loss call, all-reduced over DP)."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c for Â<0 (official code keeps verl's 3); None = off."""

    def __post_init__(self) -> None:
        check(self, positive=("step_low", "step_high"), caps=("dual_clip_c",),
              choices={"contribution": BAPO_CONTRIBUTIONS, "order": BAPO_ORDERS, "scope": BAPO_SCOPES})
        if not 0 < self.target_share < 1:
            raise ValueError(f"BapoParams.target_share={self.target_share} not in (0, 1)")
        for key in ("low_range", "high_range"):
            lo, hi = getattr(self, key)
            if not 0 < lo <= hi:
                raise ValueError(f"BapoParams.{key}={(lo, hi)} must satisfy 0 < lo <= hi")


@dataclass(kw_only=True, slots=True)
class SapoParams:
    """SAPO (arXiv 2511.20347): soft gate ``(4/τ)·σ(τ(ρ-1))``."""

    tau_pos: float = 1.0
    """τ for Â>0; 1.0 (verl / SAPO defaults)."""
    tau_neg: float = 1.05
    """τ for Â≤0; 1.05."""

    def __post_init__(self) -> None:
        check(self, positive=("tau_pos", "tau_neg"))


@dataclass(kw_only=True, slots=True)
class CispoParams:
    """CISPO (MiniMax-M1): REINFORCE with the IS weight clipped to [1-ε_low, 1+ε_high], detached."""

    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_low", "eps_high"))


@dataclass(kw_only=True, slots=True)
class GppoParams:
    """(CE-)GPPO: gradient-preserving clipping outside [1-ε_low, 1+ε_high]."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta_low: float = 1.0
    """β₁ for Â<0, ρ<1-ε_low; GPPO 1.0, CE-GPPO 0.75."""
    beta_high: float = 1.0
    """β₂ for Â>0, ρ>1+ε_high; 1.0."""
    dual_clip_c: float | None = None
    """Dual-clip c (verl's 3 if wanted); None = off."""

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_low", "eps_high", "beta_low", "beta_high"), caps=("dual_clip_c",))


@dataclass(kw_only=True, slots=True)
class MaspoParams:
    """MASPO (arXiv 2602.17550 §4, App. A.3): mass-adaptive, risk-adjusted Gaussian gate widths."""

    sigma_base: float = 1.0
    """σ_base in m = min(σ_base / p_old^α, sigma_cap); 1.0 (§5.1)."""
    alpha: float = 0.3
    """Mass exponent α; 0.3 for 7B (Table 1 = Table 5 row), 0.5 for 14B (§5.4) and in the 1.5B
    ablation (App. D.4). 0 disables mass adaptation."""
    beta_high: float = 0.03
    """β_high: σ_pos = m·clip(1 + β_high·Â, risk_min, risk_max); 0.03 (§5.1)."""
    beta_low: float = 0.03
    """β_low: σ_neg = m·clip(1 / (1 - β_low·Â), risk_min, risk_max); 0.03 (§5.1)."""
    sigma_cap: float = 10.0
    """Cap on m (reference code `maspo_sigma_high`); 10."""
    risk_min: float = 0.1
    """Lower clamp of the risk factor (reference code `maspo_adv_low`); 0.1."""
    risk_max: float = 10.0
    """Upper clamp of the risk factor (reference code `maspo_adv_high`); 10."""
    safety_cap: float | None = None
    """Optional cap for Â<0 with ρ > c (constant loss -c·Â, w = 0). Absent in the paper and the
    reference code; None = off (fidelity)."""

    def __post_init__(self) -> None:
        check(self, positive=("sigma_base", "sigma_cap", "risk_min", "risk_max"),
              non_negative=("alpha", "beta_high", "beta_low"), caps=("safety_cap",))
        if self.risk_min > self.risk_max:
            raise ValueError(f"MaspoParams.risk_min={self.risk_min} > risk_max={self.risk_max}")


@dataclass(kw_only=True, slots=True)
class QuatroParams:
    """QUATRO **reconstruction** (arXiv 2602.04620; every choice is a switch, none is the paper's)."""

    divergence: str = "kl_new_old"
    """Stabiliser D(ρ): 'kl_new_old' ρ·log ρ, 'kl_old_new' -log ρ, 'k3' ρ - 1 - log ρ."""
    delta: float = 0.01
    """δ_q: per-prompt trust-region radius; unknown in the paper."""
    dual_solver: str = "fixed"
    """λ_q: 'fixed' (lambda_init), 'dual_ascent' (one projected step on the prompt's mean divergence
    over all its tokens of the mini-batch), 'reps_closed_form' (REPS dual over the prompt's G Â)."""
    lambda_init: float = 0.1
    lambda_lr: float = 1.0
    lambda_min: float = 0.0
    lambda_max: float = 100.0
    drop_zero_mean_term: bool = False
    """Use ρ log ρ - ρ + 1 (drops the zero-mean '+1' of the gradient)."""
    keep_ratio_clip: bool = False
    """PPO-clip the ρ·Â part with eps_low / eps_high."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None

    def __post_init__(self) -> None:
        check(self, positive=("lambda_max",), caps=("dual_clip_c",),
              non_negative=("delta", "lambda_init", "lambda_lr", "lambda_min", "eps_low", "eps_high"),
              choices={"divergence": QUATRO_DIVERGENCES, "dual_solver": QUATRO_SOLVERS})
        if self.lambda_min > self.lambda_max:
            raise ValueError(f"QuatroParams.lambda_min={self.lambda_min} > lambda_max={self.lambda_max}")


@dataclass(kw_only=True, slots=True)
class EntropyAdvParams:
    """Entropy Advantage (arXiv 2506.14758): Â' = Â + min(coef·sg[H], |Â|/kappa)."""

    coef: float = 0.0
    """α; 0 = off; 0.4 with GRPO (third-party re-implementation citing the paper)."""
    kappa: float = 2.0
    """κ; 2."""

    def __post_init__(self) -> None:
        check(self, positive=("kappa",), non_negative=("coef",))


@dataclass(kw_only=True, slots=True)
class AdvReweightParams:
    """Advantage Reweighting (arXiv 2505.12929): Â' = (alpha·sg[p_old] + 1 - alpha)·Â."""

    alpha: float = 0.0
    """α_A; 0 = off; MASPO's baseline 0.1 (MASPO §5.1), original paper 0.3."""

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"AdvReweightParams.alpha={self.alpha} not in [0, 1]")
