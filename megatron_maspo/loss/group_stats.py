"""Statistics over a whole prompt group or a whole mini-batch, computed before the loss calls.

The packer splits a prompt's G responses over DP ranks and micro-batches, so a statistic computed
inside one loss call sees only part of a group (QUATRO's REPS dual of a 2-correct/6-wrong group is
7.03 on the group but 6.66 / 7.42 on two halves) or part of a mini-batch (BAPO's bounds). These
functions compute such statistics once, over everything they are defined on, and the trainer hands
the result to every loss call (``LossInputs.batch_stats``):

- per prompt, from the rollout alone (``reps_prompt_lambdas``): QUATRO's REPS dual over all G
  advantages of the prompt; carried per sample (``Sample.group_stats``) and broadcast to tokens;
- per mini-batch, at the current policy (``mini_batch_stats``): BAPO's bounds (Alg. 1: searched on
  the optimizer step's whole batch) and QUATRO's dual-ascent λ_q (the prompt's mean divergence over
  all its tokens). Inputs are this rank's tokens of the mini-batch, all micro-batches concatenated;
  one SUM all-reduce over the DP group completes them, so every rank gets the same values whatever
  the DP size, micro-batch count or packing order.

Group advantages themselves are computed on the full ``[P, G]`` reward matrix before packing
(`advantages.compute_advantages`). No megatron import here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_maspo.loss.advantages import entropy_advantage, reweight_advantage
from megatron_maspo.loss.bapo import bapo_search_bounds
from megatron_maspo.loss.base import clamped_log_ratio
from megatron_maspo.loss.config import BAPO_METHODS, LossConfig
from megatron_maspo.loss.inputs import LossInputs
from megatron_maspo.loss.quatro import quatro_divergence, reps_lambda
from megatron_maspo.parallel import comm

LAMBDA_KEY = "quatro/lambda"
"""Per-sample / per-token key of QUATRO's dual variable λ_q."""


def needs_current_logprobs(cfg: LossConfig) -> bool:
    """True if the mini-batch statistics need log π_θ of the whole mini-batch before its gradient."""
    return ((cfg.method in BAPO_METHODS and cfg.params.scope == "mini_batch")
            or (cfg.method == "quatro" and cfg.quatro.dual_solver == "dual_ascent"))


def needs_prompt_stats(cfg: LossConfig) -> bool:
    """True if a per-prompt statistic is computed from the rollout alone (REPS dual)."""
    return cfg.method == "quatro" and cfg.quatro.dual_solver == "reps_closed_form"


def reps_prompt_lambdas(cfg: LossConfig, advantages: Sequence[float], prompt_index: Sequence[int]
                        ) -> dict[int, float]:
    """QUATRO's REPS dual λ_q of every prompt over all of its responses.

    Args:
        cfg: cfg.quatro (delta, lambda_min, lambda_max).
        advantages: Â_i of every response (one per sample, the whole rollout batch).
        prompt_index: the prompt of each response (same length).

    Returns:
        ``{prompt_index: λ_q}``.
    """
    if len(advantages) != len(prompt_index):
        raise ValueError(f"{len(advantages)} advantages for {len(prompt_index)} prompt indices")
    if not advantages:
        return {}
    uniq, idx = torch.unique(torch.tensor(list(prompt_index), dtype=torch.long), return_inverse=True)
    lam = reps_lambda(torch.tensor(list(advantages), dtype=torch.float64), idx, len(uniq), cfg)
    return {int(p): float(v) for p, v in zip(uniq.tolist(), lam.tolist())}


def prompt_group_stats(cfg: LossConfig, adv_P_G: torch.Tensor) -> list[dict[str, float]]:
    """Per-prompt statistics of the rollout, one dict per row of ``adv_P_G`` ([P, G] advantages).

    Empty dicts unless a statistic is configured (today: QUATRO's REPS λ_q, key ``quatro/lambda``).
    """
    if not needs_prompt_stats(cfg):
        return [{} for _ in range(adv_P_G.shape[0])]
    p, g = adv_P_G.shape
    lam = reps_prompt_lambdas(cfg, adv_P_G.reshape(-1).tolist(), [i for i in range(p) for _ in range(g)])
    return [{LAMBDA_KEY: lam[i]} for i in range(p)]


def effective_advantages(cfg: LossConfig, adv: torch.Tensor, old_logprobs: torch.Tensor,
                         entropy: torch.Tensor | None) -> torch.Tensor:
    """Â' after the optional per-token modifiers (Entropy Advantage, then Reweighting); [T] detached.

    The same function feeds the surrogate (`policy.compute_policy_loss`) and the bound search, so
    BAPO's share is measured on the advantages the loss uses.
    """
    adv = adv.detach()
    if cfg.entropy_adv.coef > 0:
        if entropy is None:
            raise ValueError("entropy [T] is required because loss.entropy_adv.coef > 0")
        adv = entropy_advantage(adv, entropy, cfg.entropy_adv.coef, cfg.entropy_adv.kappa)
    if cfg.adv_reweight.alpha > 0:
        adv = reweight_advantage(adv, old_logprobs.detach(), cfg.adv_reweight.alpha)
    return adv


def mini_batch_stats(cfg: LossConfig, inputs: LossInputs, prompts: Sequence[int], *,
                     dp_group: dist.ProcessGroup | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Mini-batch statistics at the current policy (BAPO bounds, QUATRO dual-ascent λ_q).

    Every DP rank calls it with its own tokens of the mini-batch (all its micro-batches
    concatenated; an empty ``[0]`` shard is fine) and the same ``prompts``; at most one SUM
    all-reduce over ``dp_group`` runs. Non-finite inputs count as masked.

    Args:
        cfg: the loss configuration (method 'bapo' or 'quatro' with dual_ascent; else nothing).
        inputs: this rank's tokens: ``logprobs`` [T] log π_θ at the current parameters (detached
            inside), ``old_logprobs`` [T], ``advantages`` [T] (before the modifiers, applied here
            as in the loss), ``mask`` [T], ``prompt_ids`` [T] int64 (required) and ``entropy`` [T]
            (only with entropy_adv.coef > 0); the global counts and other fields are not read.
        prompts: every prompt index of the mini-batch (all DP ranks), identical on every rank.
        dp_group: the data-parallel group, or None for one process.

    Returns:
        (batch_stats, prompt_lambda): ``batch_stats`` holds 0-d float64 ``bapo/c_low``,
        ``bapo/c_high``, ``bapo/pos_share`` for BAPO; ``prompt_lambda`` maps each prompt of
        ``prompts`` to λ_q for QUATRO dual ascent. Both empty for other methods.
    """
    logprobs, old_logprobs, advantages = inputs.logprobs, inputs.old_logprobs, inputs.advantages
    mask, prompt_ids, entropy = inputs.mask, inputs.prompt_ids, inputs.entropy
    stats: dict[str, torch.Tensor] = {}
    lambdas: dict[int, float] = {}
    if not needs_current_logprobs(cfg):
        return stats, lambdas
    lp, old = logprobs.detach().double(), old_logprobs.detach().double()
    valid = mask.bool() & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(advantages)
    lp, old = torch.where(valid, lp, 0.0), torch.where(valid, old, 0.0)
    log_ratio = clamped_log_ratio(lp, old, cfg.log_ratio_clamp)
    if cfg.method in BAPO_METHODS:
        ent = None if entropy is None else torch.where(valid, entropy.detach().double(), 0.0)
        adv = effective_advantages(cfg, torch.where(valid, advantages.double(), 0.0), old, ent)
        c_low, c_high, share = bapo_search_bounds(torch.exp(log_ratio), adv, valid, cfg, dp_group)
        stats = {k: torch.tensor(v, dtype=torch.float64, device=lp.device) for k, v in
                 (("bapo/c_low", c_low), ("bapo/c_high", c_high), ("bapo/pos_share", share))}
        return stats, lambdas
    # QUATRO dual ascent: the prompt's mean detached divergence over all of its tokens.
    if prompt_ids is None:
        raise ValueError("QUATRO's dual ascent needs inputs.prompt_ids [T]")
    order = {p: k for k, p in enumerate(prompts)}
    if len(order) != len(prompts):
        raise ValueError("prompts must not repeat")
    try:
        slot = torch.tensor([order[int(p)] for p in prompt_ids.tolist()], dtype=torch.long,
                            device=lp.device)
    except KeyError as e:
        raise ValueError(f"prompt {e.args[0]} of this shard is not in `prompts`") from None
    d = quatro_divergence(log_ratio, cfg.quatro.divergence, cfg.quatro.drop_zero_mean_term)
    m = valid.double()
    sums = torch.zeros(2, len(prompts), dtype=torch.float64, device=lp.device)  # NCCL: on device
    sums[0].index_add_(0, slot, d * m)
    sums[1].index_add_(0, slot, m)
    if dp_group is not None:
        comm.all_reduce(sums, group=dp_group)
    d_hat = sums[0] / sums[1].clamp_min(1.0)
    lam = torch.clamp(cfg.quatro.lambda_init + cfg.quatro.lambda_lr * (d_hat - cfg.quatro.delta),
                      cfg.quatro.lambda_min, cfg.quatro.lambda_max)
    return stats, {p: float(v) for p, v in zip(prompts, lam.tolist())}
