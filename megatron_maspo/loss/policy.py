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

import torch
import torch.distributed as dist

from megatron_maspo.loss.base import TokenContext
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.group_stats import effective_advantages
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


def compute_policy_loss(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, *, num_tokens_global: float,
                        num_seqs_global: float | None = None, seq_ids: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                        rollout_logprobs: torch.Tensor | None = None,
                        prompt_ids: torch.Tensor | None = None,
                        dp_group: dist.ProcessGroup | None = None,
                        batch_stats: dict[str, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the aggregated policy loss, and its detached metrics.

    Args:
        cfg: the loss configuration.
        logprobs: [T] fp32 log π_θ of the sampled tokens of a packed micro-batch (carries gradient).
        old_logprobs: [T] log π_old (trainer-recomputed, temperature-scaled).
        advantages: [T] Â per token (the response's advantage broadcast).
        mask: [T] bool, valid response tokens.
        num_tokens_global: N, valid tokens of the whole mini-batch (all micro-batches and DP×CP
            ranks), counted before the first forward; also the metrics' divisor. 0 is clamped to 1.
        num_seqs_global: S, responses of the mini-batch (seq-mean-* aggregation).
        seq_ids: [T] int64 response index per token (seq-mean-token-mean, QUATRO REPS, GSPO's
            sequence ratio, the 'seq_mask' correction); a response's tokens must all be in this call.
        entropy: [T] H_t of π_θ (with gradient if entropy_coef > 0; detached use for Entropy Adv.).
        ref_logprobs: [T] log π_ref (needed when kl_coef > 0).
        rollout_logprobs: [T] rollout-engine log-probs (needed when a rollout correction is on).
        prompt_ids: [T] int64 prompt index per token (QUATRO's per-prompt duals).
        dp_group: DP group for BAPO's bound search (one all-reduce), or None.
        batch_stats: statistics over whole groups / the whole mini-batch computed before this call
            (`group_stats.py`): 0-d ``bapo/{c_low,c_high,pos_share}``, [T] ``quatro/lambda``. They
            replace BAPO's per-call search and QUATRO's per-call λ_q.

    Returns:
        (loss, metrics): loss is 0-d; summing it over micro-batches and SUM-reducing gradients over
        DP gives the exact mini-batch loss (`reduce.megatron_loss_tuple` repackages it for Megatron's
        3-tuple path). metrics are detached 0-d tensors, see `metrics.py` for their reduction.

    Raises:
        ValueError/TypeError: shape mismatch, missing inputs for the chosen options, non-finite
            inputs with nonfinite='raise' ('skip' masks and counts like 'mask'; skipping the
            optimizer step is the trainer's decision).
    """
    check_token_inputs(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                       seq_ids=seq_ids, entropy=entropy, ref_logprobs=ref_logprobs,
                       rollout_logprobs=rollout_logprobs, prompt_ids=prompt_ids)
    needs = {"entropy": (cfg.entropy_coef > 0 or cfg.entropy_adv.coef > 0, entropy,
                         "entropy_coef / entropy_adv.coef > 0"),
             "ref_logprobs": (cfg.kl_coef > 0, ref_logprobs, "kl_coef > 0"),
             "rollout_logprobs": (cfg.corrects_rollout, rollout_logprobs,
                                  f"rollout_correction.mode={cfg.effective_rollout_correction.mode!r}")}
    for name, (needed, t, why) in needs.items():
        if needed and t is None:
            raise ValueError(f"{name} [T] is required because LossConfig.{why}")
    if num_tokens_global <= 0:
        logger.warning("num_tokens_global=%s: no valid token in the mini-batch; dividing by 1",
                       num_tokens_global)
        num_tokens_global = 1
    n_glob = float(num_tokens_global)
    mask, t, n_bad = _screen_nonfinite(cfg, mask.bool(), {
        "logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages,
        "entropy": entropy, "ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs})
    lp, old, adv = t["logprobs"], t["old_logprobs"].detach(), t["advantages"].detach()
    adv = effective_advantages(cfg, adv, old, t["entropy"])
    stats = dict(batch_stats or {})
    if "quatro/lambda" in stats:
        check_token_inputs(logprobs=logprobs, **{"quatro/lambda": stats["quatro/lambda"]})
    ctx = TokenContext(mask=mask, seq_ids=seq_ids, prompt_ids=prompt_ids, dp_group=dp_group,
                       batch_stats=stats)
    out = surrogate(cfg, lp, old, adv, ctx)
    pg = out.loss
    metrics: dict[str, torch.Tensor] = {}
    m = mask.to(lp.dtype)
    if cfg.corrects_rollout:
        rc = cfg.effective_rollout_correction
        c, dropped = correction_factor(rc, old, t["rollout_logprobs"], mask, seq_ids)
        pg = pg * c.to(pg.dtype)
        metrics.update(correction_metrics(rc, c.to(m.dtype), dropped, mask, n_glob))

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, mask, cfg.effective_aggregation, num_tokens_global=n_glob,
                         num_seqs_global=num_seqs_global, seq_ids=seq_ids,
                         norm_constant=cfg.norm_constant)

    loss = agg(pg)
    metrics["loss/pg"] = loss.detach()
    if cfg.kl_coef > 0:
        kl_term = agg(kl_to_reference(lp, t["ref_logprobs"], cfg.kl_type))
        loss = loss + cfg.kl_coef * kl_term
        metrics["loss/kl"] = kl_term.detach()
    if entropy is not None:
        ent = t["entropy"]
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
