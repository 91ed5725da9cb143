"""`compute_policy_loss`: the trainer's entry, composing surrogate, regularisers and aggregation.

Per token (loss-formulas.md §0–§13), with Â' the advantage after the optional modifiers:

    ℓ_t = c_t·surrogate_t(ρ, Â') + β_KL·KL_t(π_θ ‖ π_ref) - c_H·H_t
    Â'  = reweight(entropy_advantage(Â))          (each off by default)

with c_t the rollout correction (`rollout_correction.py`: TIS, token/IcePop/sequence masks; 1 when
off), then aggregated with the global counts (`reduce.aggregate`). No collective runs here except BAPO's
single all-reduce over the explicitly passed ``dp_group``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_maspo.loss.base import TokenContext
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.group_stats import effective_advantages
from megatron_maspo.loss.inputs import LossInputs
from megatron_maspo.loss.kl import approx_kl_old_new, kl_to_reference
from megatron_maspo.loss.metrics import gate_metrics
from megatron_maspo.loss.reduce import aggregate
from megatron_maspo.loss.registry import check_token_inputs, surrogate
from megatron_maspo.loss.rollout_correction import correction_factor, correction_metrics

logger = logging.getLogger(__name__)


def _screen_nonfinite(cfg: LossConfig, mask: torch.Tensor, tensors: dict[str, torch.Tensor | None]
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None], torch.Tensor]:
    """Raise on, or mask out, non-finite inputs at valid tokens; returns (mask, cleaned, count)."""
    per_input = {name: ~torch.isfinite(t.detach()) & mask for name, t in tensors.items() if t is not None}
    bad = torch.zeros_like(mask)
    for nf in per_input.values():
        bad |= nf
    if cfg.nonfinite == "raise" and bool(bad.any()):  # one host sync per call, not one per input
        names = {n: int(nf.sum()) for n, nf in per_input.items() if nf.any()}
        raise ValueError(", ".join(f"{n} has {c} non-finite value(s)" for n, c in names.items())
                         + " at valid tokens (set LossConfig.nonfinite='mask' to drop them)")
    cleaned: dict[str, torch.Tensor | None] = {}
    for name, t in tensors.items():
        # where() (not multiply) so a NaN never reaches the graph: its gradient is exactly 0.
        cleaned[name] = None if t is None else torch.where(torch.isfinite(t.detach()), t, torch.zeros_like(t))
    return mask & ~bad, cleaned, bad.sum()


def compute_policy_loss(cfg: LossConfig, inputs: LossInputs, *,
                        dp_group: dist.ProcessGroup | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the aggregated policy loss, and its detached metrics.

    Args:
        cfg: the loss configuration.
        inputs: the micro-batch's ``[T]`` tensors and the mini-batch's global counts
            (:class:`~megatron_maspo.loss.inputs.LossInputs`: ``logprobs`` carries the gradient;
            ``entropy`` too when ``entropy_coef > 0``).
        dp_group: DP group for BAPO's bound search (one all-reduce), or None.

    Returns:
        (loss, metrics): loss is 0-d; summing it over micro-batches and SUM-reducing gradients over
        DP gives the exact mini-batch loss (`reduce.megatron_loss_tuple` repackages it for Megatron's
        3-tuple path). metrics are detached 0-d tensors, see `metrics.py` for their reduction.

    Raises:
        ValueError/TypeError: shape mismatch, missing inputs for the chosen options, non-finite
            inputs with nonfinite='raise' ('skip' masks and counts like 'mask'; skipping the
            optimizer step is the trainer's decision).
    """
    check_token_inputs(inputs.token_tensors())
    needs = {"entropy": (cfg.entropy_coef > 0 or cfg.entropy_adv.coef > 0, inputs.entropy,
                         "entropy_coef / entropy_adv.coef > 0"),
             "ref_logprobs": (cfg.kl_coef > 0, inputs.ref_logprobs, "kl_coef > 0"),
             "rollout_logprobs": (cfg.corrects_rollout, inputs.rollout_logprobs,
                                  f"rollout_correction.mode={cfg.effective_rollout_correction.mode!r}")}
    for name, (needed, t, why) in needs.items():
        if needed and t is None:
            raise ValueError(f"{name} [T] is required because LossConfig.{why}")
    num_tokens_global = inputs.num_tokens_global
    if num_tokens_global <= 0:
        logger.warning("num_tokens_global=%s: no valid token in the mini-batch; dividing by 1",
                       num_tokens_global)
        num_tokens_global = 1
    n_glob = float(num_tokens_global)
    mask, t, n_bad = _screen_nonfinite(cfg, inputs.mask.bool(), {
        "logprobs": inputs.logprobs, "old_logprobs": inputs.old_logprobs,
        "advantages": inputs.advantages, "entropy": inputs.entropy,
        "ref_logprobs": inputs.ref_logprobs, "rollout_logprobs": inputs.rollout_logprobs})
    # From here on: finite values only, the screened mask and the clamped count.
    clean = replace(inputs, mask=mask, num_tokens_global=n_glob, **t)
    lp, old, adv = clean.logprobs, clean.old_logprobs.detach(), clean.advantages.detach()
    adv = effective_advantages(cfg, adv, old, clean.entropy)
    stats = dict(inputs.batch_stats)
    if "quatro/lambda" in stats:
        check_token_inputs({"logprobs": inputs.logprobs, "quatro/lambda": stats["quatro/lambda"]})
    ctx = TokenContext(mask=mask, seq_ids=inputs.seq_ids, prompt_ids=inputs.prompt_ids,
                       dp_group=dp_group, batch_stats=stats)
    out = surrogate(cfg, lp, old, adv, ctx)
    pg = out.loss
    metrics: dict[str, torch.Tensor] = {}
    m = mask.to(lp.dtype)
    if cfg.corrects_rollout:
        rc = cfg.effective_rollout_correction
        c, dropped = correction_factor(rc, old, clean.rollout_logprobs, mask, inputs.seq_ids)
        pg = pg * c.to(pg.dtype)
        metrics.update(correction_metrics(rc, c.to(m.dtype), dropped, mask, n_glob))

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, clean, cfg.effective_aggregation, norm_constant=cfg.norm_constant)

    loss = agg(pg)
    metrics["loss/pg"] = loss.detach()
    if cfg.kl_coef > 0:
        kl_term = agg(kl_to_reference(lp, clean.ref_logprobs, cfg.kl_type))
        loss = loss + cfg.kl_coef * kl_term
        metrics["loss/kl"] = kl_term.detach()
    if inputs.entropy is not None:
        ent = clean.entropy
        metrics["policy/entropy_mean"] = (ent.detach() * m).sum() / n_glob
        if cfg.entropy_coef > 0:
            ent_term = agg(ent)
            loss = loss - cfg.entropy_coef * ent_term
            metrics["loss/entropy"] = ent_term.detach()
    metrics["loss/total"] = loss.detach()
    metrics["loss/nonfinite_tokens"] = n_bad.to(lp.dtype)
    log_ratio = torch.clamp(lp.detach() - old, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    metrics["policy/approx_kl"] = (approx_kl_old_new(log_ratio) * m).sum() / n_glob
    metrics.update(gate_metrics(out, adv, mask, n_glob, old))
    return loss, metrics
