"""Per-method parameter groups of `LossConfig` (``loss.<method>.<field>``), each validated where defined.

Each surrogate reads only its own group (``cfg.params`` is the group of ``cfg.method``), so a method's
defaults are its own: ``clip_higher`` clips at 1 + 0.265 without touching ``grpo``'s 0.2. Defaults
cite their source and its section. "verl default" marks a value the MASPO paper does not state: the
paper says its baseline settings are in its Table 4, which the text we have lacks, so no baseline value
here can be verified against MASPO's comparison (`docs/losses.md` "Sources of the defaults").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

VERL_DUAL_CLIP = 3.0
"""verl's ``clip_ratio_c`` default (verl actor config): Â<0 tokens with ρ > 3 get the constant loss
-3·Â (w = 0). Not stated by the MASPO paper (whose baseline table, Table 4, is missing from our text)."""

GSPO_EPS_LOW = 3e-4
GSPO_EPS_HIGH = 4e-4
"""GSPO's sequence-ratio clip range (GSPO paper, arXiv 2507.18071, §5.1 experimental setup: left and
right clipping ranges 3e-4 and 4e-4)."""

ROLLOUT_CORRECTION_MODES = ("none", "tis", "token_mask", "icepop", "seq_mask")
ICEPOP_BAND = (0.5, 5.0)
"""IcePop's acceptance band [α, β] of π_train/π_infer. IcePop itself (Ling team: IcePop blog; Ring-1T report,
arXiv 2510.18855) defines the band; these two values are the ones verl's rollout-correction docs give for
IcePop (``rollout_is_threshold="0.5_5.0"``), not checked here against a primary source: unverified."""
GEO_RS_BAND = (1.0 / 1.001, 1.0 / 0.999)
"""verl's Geo-RS preset (``RolloutCorrectionConfig.decoupled_geo_rs``: ``rollout_rs="seq_mean_k1"``,
``rollout_rs_threshold="0.999_1.001"``) in our k = π_old/π_rollout. verl bounds the k1 statistic
mean_t(−log k_t) by [log 0.999, log 1.001], i.e. the geometric mean of k by [1/1.001, 1/0.999]."""

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
    if getattr(obj, "eps_low", None) is not None and obj.eps_low >= 1:
        raise ValueError(f"{name}.eps_low={obj.eps_low} must be < 1 (band [1-eps_low, ...])")


@dataclass(kw_only=True, slots=True)
class ClipParams:
    """PPO-clip band [1-ε_low, 1+ε_high] with an optional dual-clip (grpo, clip_higher)."""

    eps_low: float = 0.2
    """ε_low; 0.2 for every clip baseline (MASPO §5.1)."""
    eps_high: float = 0.2
    """ε_high; 0.2 (GRPO, MASPO §5.1). Clip-Higher's group defaults to 0.265 (MASPO App. D.1)."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c for Â<0, ρ>c (constant loss -c·Â, w = 0); 3 = verl's default ``clip_ratio_c``, not
    a MASPO-paper value (whether its baselines used it is unknown: Table 4 is missing from the text;
    DCPO uses 10). None = off; `scripts/compare_losses.py` runs both."""

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_low", "eps_high"), caps=("dual_clip_c",))


@dataclass(kw_only=True, slots=True)
class DacParams:
    """DAC (DCPO, arXiv 2509.02333): bounds L(p_old), U(p_old) from ε_low, ε_high."""

    eps_low: float = 0.2
    """ε_low of L(p_old); 0.2 (MASPO §5.1 "ε_low and ε_high are both set to 0.2"; DCPO scripts 0.2)."""
    eps_high: float = 0.2
    """ε_high of U(p_old); 0.2 (MASPO §5.1; DCPO scripts 0.28)."""
    upper_cap: float = 10.0
    """Clamp on U(p_old) (DCPO code: max(clip_ratio_c, 10)); 10."""
    p_old_floor: float = 1e-12
    """Floor on p_old before dividing by it."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c (verl default 3, not a MASPO-paper value; DCPO 10); None = off."""

    def __post_init__(self) -> None:
        check(self, positive=("upper_cap", "p_old_floor"), non_negative=("eps_low", "eps_high"),
              caps=("dual_clip_c",))


@dataclass(kw_only=True, slots=True)
class BapoParams:
    """BAPO (Xi et al. 2025, arXiv 2510.18927, Alg. 1, Eq. 8): PPO-clip with searched ratio bounds.

    ``loss.bapo`` follows the values the BAPO authors' README (WooooDyy/BAPO) states "as used in the
    paper" (ρ₀ and both search ranges) and the paper's Alg. 1 order; its step sizes are the paper's §5
    as first read here, which the README does not state (not re-checked). ``loss.bapo_code`` (method
    'bapo_code') follows the authors' *released code* (``recipe/bapo``: config defaults and example
    script). The MASPO paper gives no BAPO setting (its Table 4 is missing from our text).
    """

    target_share: float = 0.5
    """ρ₀: target share P/(P+N) of the positive contribution; 0.5, the value the BAPO authors' README
    gives "as used in the paper" (an earlier 0.4 cited the paper's §5, which could not be checked).
    Ignored when ``target_ratio`` is set."""
    target_ratio: float | None = None
    """Target of P/N instead of the share (released code's criterion; it passes 0.5, share 1/3)."""
    low_range: tuple[float, float] = (0.6, 0.9)
    """(a⁻, b⁻): search range of c_low; (0.6, 0.9) (BAPO README, "as used in the paper"; released code
    0.6→0.8)."""
    high_range: tuple[float, float] = (1.2, 3.0)
    """(a⁺, b⁺): search range of c_high; (1.2, 3.0) (BAPO README, "as used in the paper"; released code
    1.2→2.0)."""
    step_low: float = 0.02
    """δ₂: c_low increment; 0.02 (BAPO paper §5 as first read, not in the README; released code 0.05)."""
    step_high: float = 0.05
    """δ₁: c_high increment; 0.05 (BAPO paper §5 and released code)."""
    contribution: str = "loss_value"
    """Negatives count as 'loss_value' |Â|·max(ρ, c_low) (paper Eq. 8 and code) or 'gradient_mass'
    |Â|·ρ over ρ ≥ c_low only (our option)."""
    order: str = "high_first"
    """'high_first' (BAPO paper Alg. 1) or 'low_first' (released code); either raises the other bound
    once the first is exhausted."""
    scope: str = "mini_batch"
    """Tokens the search sees: 'mini_batch' (Alg. 1: the optimizer step's whole batch at the current
    policy, over all micro-batches and DP ranks; one extra forward-only pass per mini-batch after
    the first) or 'micro_batch' (released code: each loss call, all-reduced over DP)."""
    dual_clip_c: float | None = VERL_DUAL_CLIP
    """Dual-clip c for Â<0; 3 (released code keeps verl's ``clip_ratio_c``; the BAPO paper does not
    state one); None = off."""

    @property
    def share_threshold(self) -> float:
        """The share the search must reach: ρ₀, or t/(1+t) for a P/N target t (P/N ≥ t ⇔ share ≥ t/(1+t))."""
        t = self.target_ratio
        return self.target_share if t is None else t / (1.0 + t)

    def __post_init__(self) -> None:
        check(self, positive=("step_low", "step_high"), caps=("dual_clip_c",),
              choices={"contribution": BAPO_CONTRIBUTIONS, "order": BAPO_ORDERS, "scope": BAPO_SCOPES})
        if not 0 < self.target_share < 1:
            raise ValueError(f"BapoParams.target_share={self.target_share} not in (0, 1)")
        if self.target_ratio is not None and not (math.isfinite(self.target_ratio) and self.target_ratio > 0):
            raise ValueError(f"BapoParams.target_ratio={self.target_ratio} must be None or finite and > 0")
        for key in ("low_range", "high_range"):
            lo, hi = getattr(self, key)
            if not 0 < lo <= hi:
                raise ValueError(f"BapoParams.{key}={(lo, hi)} must satisfy 0 < lo <= hi")


def bapo_released_code() -> BapoParams:
    """BAPO as its authors' released code runs it (WooooDyy/BAPO ``recipe/bapo``; docs/loss-formulas.md §8):
    P/N target 0.5 (example script), c_low first, ranges 0.6→0.8 / 1.2→2.0, steps 0.05, searched per
    loss call, dual-clip 3."""
    return BapoParams(target_ratio=0.5, low_range=(0.6, 0.8), high_range=(1.2, 2.0), step_low=0.05,
                      step_high=0.05, order="low_first", scope="micro_batch")


@dataclass(kw_only=True, slots=True)
class SapoParams:
    """SAPO (arXiv 2511.20347): soft gate ``(4/τ)·σ(τ(ρ-1))``."""

    tau_pos: float = 1.0
    """τ for Â>0; 1.0 (SAPO paper's setting as quoted by third-party summaries; verl default)."""
    tau_neg: float = 1.05
    """τ for Â≤0; 1.05 (same sources)."""

    def __post_init__(self) -> None:
        check(self, positive=("tau_pos", "tau_neg"))


@dataclass(kw_only=True, slots=True)
class CispoParams:
    """CISPO (MiniMax-M1, arXiv 2506.13585 §3.1): REINFORCE with the detached IS weight clipped.

    The weight is ``min(ρ, 1+ε_high)`` by default: MiniMax-M1 sets no lower bound (§3.1: ε_low^IS set
    large, only ε_high^IS tuned), as verl's CISPO example does. Cited by the MASPO paper (§2.2), not
    one of its runs."""

    eps_low: float | None = None
    """ε_low^IS; None = no lower bound (MiniMax-M1 §3.1). A value clips ρ below at 1-ε_low."""
    eps_high: float = 0.2
    """ε_high^IS; 0.2 (MiniMax-M1 does not state its value; 0.2 = the PPO default, our choice)."""

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_high",))
        if self.eps_low is not None and not (math.isfinite(self.eps_low) and 0 <= self.eps_low < 1):
            raise ValueError(f"CispoParams.eps_low={self.eps_low} must be None or in [0, 1)")


@dataclass(kw_only=True, slots=True)
class GppoParams:
    """(CE-)GPPO (Klear-Reasoner, arXiv 2508.07629): gradient-preserving clipping outside
    [1-ε_low, 1+ε_high]. Cited by the MASPO paper (§2.2), not one of its runs."""

    eps_low: float = 0.2
    """ε_low; 0.2 (PPO default, our choice)."""
    eps_high: float = 0.2
    """ε_high; 0.2 (PPO default, our choice)."""
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
    """σ_base in m = min(σ_base / p_old^α, sigma_cap); 1.0 (MASPO §5.3, "we fix σ_base = 1")."""
    alpha: float = 0.3
    """Mass exponent α; 0.3 for 7B (Table 1 = Table 5 row), 0.5 for 14B (§5.4) and in the 1.5B
    ablation (App. D.4). 0 disables mass adaptation."""
    beta_high: float = 0.03
    """β_high: σ_pos = m·clip(1 + β_high·Â, risk_min, risk_max); 0.03 (MASPO §5.3 and Table 5:
    "we recommend β = 0.03 when α = 0.3")."""
    beta_low: float = 0.03
    """β_low: σ_neg = m·clip(1 / (1 - β_low·Â), risk_min, risk_max); 0.03 (MASPO §5.3, Table 5)."""
    sigma_cap: float = 10.0
    """Cap on m; 10 (MASPO App. A.3 formula, ``min(σ_base/π_old^α, 10)``; reference code
    `maspo_sigma_high`)."""
    risk_min: float = 0.1
    """Lower clamp of the risk factor; 0.1 (MASPO App. A.3 ``clip(·, 0.1, 10)``; code `maspo_adv_low`)."""
    risk_max: float = 10.0
    """Upper clamp of the risk factor; 10 (MASPO App. A.3; reference code `maspo_adv_high`)."""
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
    """QUATRO **reconstruction** (arXiv 2602.04620). Only "query-adaptive trust region, enforced
    directly" is from the abstract; Lagrangian duals per prompt and the log-ratio stabiliser follow a
    third-party summary; every value below is our reconstruction (none is the paper's)."""

    divergence: str = "kl_new_old"
    """Stabiliser D(ρ): 'kl_new_old' ρ·log ρ, 'kl_old_new' -log ρ, 'k3' ρ - 1 - log ρ."""
    delta: float = 0.01
    """δ_q: per-prompt trust-region radius; unknown in the paper."""
    dual_solver: str = "reps_closed_form"
    """λ_q: 'reps_closed_form' (default: a per-prompt dual from the prompt's G advantages, so the
    trust region adapts per query, the abstract's claim; reconstruction), 'dual_ascent' (one projected
    step on the prompt's mean divergence over all its tokens of the mini-batch) or 'fixed'
    (lambda_init for every prompt: a constant penalty, not query-adaptive)."""
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
    """α_A; 0 = off; MASPO's baseline 0.1 (MASPO App. D.1), original paper 0.3 (MASPO App. D.1)."""

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"AdvReweightParams.alpha={self.alpha} not in [0, 1]")


@dataclass(kw_only=True, slots=True)
class GspoParams:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level ratio, clipped per sequence."""

    eps_low: float = GSPO_EPS_LOW
    """Left clip range of s_i; 3e-4 (GSPO paper §5.1)."""
    eps_high: float = GSPO_EPS_HIGH
    """Right clip range of s_i; 4e-4 (GSPO paper §5.1)."""

    def __post_init__(self) -> None:
        check(self, non_negative=("eps_low", "eps_high"))


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionParams:
    """Correction for the trainer/rollout-engine mismatch k_t = π_old(t)/π_rollout(t) (`rollout_correction.py`).

    Composes with every method: the per-token surrogate loss is multiplied by a detached factor.
    Modes: 'none'; 'tis' min(k, cap) (truncated IS); 'token_mask' 1[lower ≤ k ≤ upper] (token rejection,
    verl's ``rollout_rs="token_k1"``: tokens outside dropped, no IS weight; verl's masked IS keeps k as the
    weight inside the band, which is 'icepop' here); 'icepop' k·1[lower ≤ k ≤ upper] (IcePop's
    two-sided masking with the kept ratio as IS weight); 'seq_mask' 1[lower ≤ exp(mean_t log k_t) ≤
    upper] per response (geometric-mean rejection, verl's Geo-RS). Dropped tokens stay in the
    aggregation's denominators (counted before the forward), like tokens a hard clip zeroes: the
    convention of IcePop's objective, whose mask sits inside a sum normalised by all response tokens.
    verl instead removes rejected tokens from the response mask, so its token-mean divides by the kept
    tokens: here the gradient is N_kept/N times verl's (docs/losses.md).
    """

    mode: str = "none"
    cap: float | None = None
    """C for 'tis'; required there (`loss.tis_cap` is its alias; e.g. 2)."""
    lower: float | None = None
    """Band low end; None = the mode's default: icepop 0.5 (verl's IcePop setting, unverified against
    IcePop's own text), token_mask 0.5 (ours: symmetric in log k), seq_mask 1/1.001 (verl's Geo-RS
    preset "0.999_1.001", converted to our k: ``GEO_RS_BAND``)."""
    upper: float | None = None
    """Band high end; None = icepop 5.0 (as ``lower``), token_mask 2.0 (ours), seq_mask 1/0.999 (verl's
    Geo-RS preset)."""

    def band(self) -> tuple[float, float]:
        """(lower, upper) with the mode's defaults filled in."""
        lo, hi = {"icepop": ICEPOP_BAND, "token_mask": (0.5, 2.0),
                  "seq_mask": GEO_RS_BAND}.get(self.mode, (0.0, math.inf))
        return (lo if self.lower is None else self.lower, hi if self.upper is None else self.upper)

    def __post_init__(self) -> None:
        check(self, choices={"mode": ROLLOUT_CORRECTION_MODES})
        if self.mode == "tis" and not (self.cap is not None and self.cap > 0):
            raise ValueError(f"RolloutCorrectionParams.cap={self.cap} must be > 0 for mode='tis'")
        lo, hi = self.band()
        if not 0 <= lo < hi:
            raise ValueError(f"RolloutCorrectionParams band (lower={lo}, upper={hi}) must satisfy 0 <= lower < upper")
