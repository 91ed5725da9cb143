"""`LossConfig`: the policy loss, its regularisers, advantages and aggregation.

Method parameters live in one small group per method (`params.py`): ``loss.maspo.alpha``,
``loss.clip_higher.eps_high``, ``loss.bapo.target_share`` ... (``--set loss.<method>.<field>=v``).
Each group is validated in its own ``__post_init__``; shared fields are validated here, once, so the
maths code can trust its inputs. `docs/losses.md` lists every field with its source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_maspo.loss.params import (
    AdvReweightParams,
    BapoParams,
    CispoParams,
    ClipParams,
    DacParams,
    EntropyAdvParams,
    GppoParams,
    GspoParams,
    MaspoParams,
    QuatroParams,
    RolloutCorrectionParams,
    SapoParams,
    bapo_released_code,
)

METHODS = ("grpo", "clip_higher", "dac", "bapo", "bapo_code", "sapo", "cispo", "gppo", "gspo", "maspo",
           "quatro")
BAPO_METHODS = ("bapo", "bapo_code")
AGGREGATIONS = ("auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
METHOD_AGGREGATION = {"sapo": "seq-mean-token-mean", "gspo": "seq-mean-token-mean"}
"""``aggregation='auto'``: SAPO's own sequence-mean-token-mean (verl forces it for SAPO); GSPO's
(1/G)·Σ_i (1/|y_i|)·Σ_t (GSPO paper Eq. for J_GSPO-token, §4.3); token-mean for every other method
(MASPO §4.1, DAPO)."""
ADVANTAGES = ("grpo", "drgrpo", "rloo")
KL_TYPES = ("k1", "k2", "k3")
NONFINITE = ("raise", "skip", "mask")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """Configuration of the per-token policy loss, its regularisers, advantages and aggregation."""

    method: str = "maspo"
    """Surrogate, one of METHODS; its parameters are the group of the same name. 'quatro' is a
    reconstruction."""

    # --- one parameter group per method (params.py) ---
    grpo: ClipParams = field(default_factory=ClipParams)
    clip_higher: ClipParams = field(default_factory=lambda: ClipParams(eps_high=0.265))
    """Clip-Higher as MASPO's baseline: ε_high 0.265 (MASPO App. D.1, after Skywork-OR1; DAPO 0.28)."""
    dac: DacParams = field(default_factory=DacParams)
    bapo: BapoParams = field(default_factory=BapoParams)
    """BAPO as its paper states it (arXiv 2510.18927 §5)."""
    bapo_code: BapoParams = field(default_factory=bapo_released_code)
    """BAPO as its authors' released code runs it ('bapo_code'; `params.bapo_released_code`)."""
    sapo: SapoParams = field(default_factory=SapoParams)
    cispo: CispoParams = field(default_factory=CispoParams)
    gppo: GppoParams = field(default_factory=GppoParams)
    gspo: GspoParams = field(default_factory=GspoParams)
    maspo: MaspoParams = field(default_factory=MaspoParams)
    quatro: QuatroParams = field(default_factory=QuatroParams)

    # --- aggregation ---
    aggregation: str = "auto"
    """One of AGGREGATIONS; 'auto' = the method's own (METHOD_AGGREGATION, else token-mean)."""
    norm_constant: float | None = None
    """C for 'seq-mean-token-sum-norm' (Dr.GRPO: e.g. the max response length); required there."""

    # --- regularisers and corrections ---
    entropy_coef: float = 0.0
    """c_H: entropy bonus, loss -= c_H·H_t; MASPO 0; its entropy-regularisation baseline's value is
    not stated."""
    kl_coef: float = 0.0
    """β_KL on the KL to the reference policy; MASPO 0 (App. C.3), DeepSeekMath 0.04."""
    kl_type: str = "k3"
    """KL estimator: 'k1' log π/π_ref, 'k2' ½(log π/π_ref)², 'k3' r - log r - 1 with r = π_ref/π."""
    rollout_correction: RolloutCorrectionParams = field(default_factory=RolloutCorrectionParams)
    """Trainer/rollout-engine mismatch correction (none | tis | token_mask | icepop | seq_mask), the
    one place it is configured; composes with every method and gate."""
    tis_cap: float | None = None
    """Alias of ``rollout_correction.mode='tis'`` with ``cap=tis_cap`` (pg loss ×= min(π_old/π_rollout,
    tis_cap), detached); `effective_rollout_correction` resolves it. Setting it together with a
    ``rollout_correction`` mode (other than 'tis' at the same cap) is an error."""

    # --- advantages and per-token advantage modifiers (compose with every method) ---
    advantage: str = "grpo"
    """Group estimator: 'grpo' (mean/std), 'drgrpo' (mean only), 'rloo' (leave-one-out)."""
    std_unbiased: bool = True
    """Bessel-corrected std for 'grpo' (verl's default); False = population std, what MASPO App. B's
    group statistics imply (the paper recipes set False; 6.5% smaller std at G = 8)."""
    eps_adv: float = 1e-6
    """ε_A added to the std; 1e-6 (verl)."""
    entropy_adv: EntropyAdvParams = field(default_factory=EntropyAdvParams)
    adv_reweight: AdvReweightParams = field(default_factory=AdvReweightParams)

    # --- numerics ---
    log_ratio_clamp: float = 20.0
    """|log ρ| clamp before exp; 20 (verl)."""
    nonfinite: str = "raise"
    """Non-finite log-probs/advantages at valid tokens: 'raise' an error, 'skip' the optimizer step,
    or 'mask' the tokens out and count them. The trainer agrees on it over all ranks first, so a
    raise or skip happens on every rank together; ``compute_policy_loss`` alone raises ValueError
    ('raise') or masks and counts ('skip', 'mask': the caller decides to skip)."""

    @property
    def params(self):  # noqa: ANN201 - one of the params.py groups
        """The parameter group of ``method``."""
        return getattr(self, self.method)

    @property
    def effective_rollout_correction(self) -> RolloutCorrectionParams:
        """``rollout_correction``, or TIS at ``tis_cap`` when only the alias is set."""
        if self.tis_cap is not None and self.rollout_correction.mode == "none":
            return RolloutCorrectionParams(mode="tis", cap=self.tis_cap)
        return self.rollout_correction

    @property
    def corrects_rollout(self) -> bool:
        """True when a rollout correction (TIS or a mask) uses the engine's log-probs."""
        return self.effective_rollout_correction.mode != "none"

    @property
    def effective_aggregation(self) -> str:
        """``aggregation`` with 'auto' resolved for ``method``."""
        if self.aggregation != "auto":
            return self.aggregation
        return METHOD_AGGREGATION.get(self.method, "token-mean")

    def __post_init__(self) -> None:
        choices = {"method": METHODS, "aggregation": AGGREGATIONS, "advantage": ADVANTAGES,
                   "kl_type": KL_TYPES, "nonfinite": NONFINITE}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}; accepted: {allowed}")
        for name in ("eps_adv", "log_ratio_clamp"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"LossConfig.{name}={v} must be finite and > 0")
        for name in ("entropy_coef", "kl_coef"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"LossConfig.{name}={v} must be finite and >= 0")
        if self.tis_cap is not None:
            if not self.tis_cap > 0:
                raise ValueError(f"LossConfig.tis_cap={self.tis_cap} must be None or > 0")
            rc = self.rollout_correction
            if rc.mode != "none" and (rc.mode != "tis" or rc.cap != self.tis_cap):
                raise ValueError(f"LossConfig.tis_cap={self.tis_cap} is an alias of rollout_correction.mode="
                                 f"'tis'; it conflicts with rollout_correction (mode={rc.mode!r}, cap={rc.cap})")
        if self.effective_aggregation == "seq-mean-token-sum-norm" and not (self.norm_constant or 0) > 0:
            raise ValueError("LossConfig.norm_constant must be > 0 for aggregation="
                             "'seq-mean-token-sum-norm' (Dr.GRPO's constant C)")
