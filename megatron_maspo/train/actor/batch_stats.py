"""Group- and mini-batch-level loss statistics for the actor (see `loss/group_stats.py`).

The actor calls :func:`prepare_batch_stats` before each mini-batch's forward+backward. It

1. fills per-prompt statistics that depend on the rollout only (QUATRO's REPS λ_q over all G
   responses of the prompt) into ``Sample.group_stats`` when the trainer has not already;
2. for BAPO (``bapo.scope='mini_batch'``) and QUATRO dual ascent, gets log π_θ of this rank's whole
   mini-batch at the **current** parameters and reduces the statistics over DP. On the first
   mini-batch of a rollout step the parameters are π_old's, so the recomputed ``old_logprobs`` are
   used as they are (ρ = 1 exactly, checked by ``train.check_first_ratio``); later mini-batches
   cost one forward-only pass (``probe``) over the same packing, so its log-probs equal the
   training forward's bit for bit.

Per-sample results go to ``Sample.group_stats`` (the actor broadcasts them to tokens); mini-batch
results are returned and passed to every loss call of the mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.group_stats import (
    LAMBDA_KEY,
    mini_batch_stats,
    needs_current_logprobs,
    needs_prompt_stats,
    reps_prompt_lambdas,
)
from megatron_maspo.loss.inputs import LossInputs
from megatron_maspo.train.actor.packing import MiniBatchPlan
from megatron_maspo.train.actor.samples import Sample

Probe = Callable[[], dict[int, tuple[torch.Tensor, torch.Tensor]]]
"""Runs the forward-only pass of the mini-batch on every PP stage: ``{sample: ([L'] lp, [L'] H)}``
on the last stage (empty elsewhere)."""


def fill_prompt_stats(cfg: LossConfig, samples: Sequence[Sample]) -> None:
    """Per-prompt statistics from the rollout alone, over every sample of the prompt (in place)."""
    if not needs_prompt_stats(cfg) or all(LAMBDA_KEY in s.group_stats for s in samples):
        return
    lam = reps_prompt_lambdas(cfg, [s.advantage for s in samples], [s.prompt_index for s in samples])
    for s in samples:
        s.group_stats.setdefault(LAMBDA_KEY, lam[s.prompt_index])


def prepare_batch_stats(cfg: LossConfig, samples: Sequence[Sample], plan: MiniBatchPlan, *,
                        at_old_policy: bool, probe: Probe, is_last_stage: bool,
                        dp_group: dist.ProcessGroup | None, device: torch.device
                        ) -> dict[str, torch.Tensor]:
    """Statistics of one mini-batch, identical on every DP rank; see the module docstring.

    Args:
        at_old_policy: the parameters are still π_old's (no optimizer step since the recompute).
        probe: the forward-only pass (called on every rank when needed, so PP stages stay in step).
        is_last_stage: only the last PP stage holds log-probs and computes the loss.
        dp_group: data-parallel group of the reduction.
        device: where the reduced tensors live (NCCL needs device tensors).

    Returns:
        0-d tensors for every loss call of the mini-batch (BAPO's bounds), possibly empty.
    """
    fill_prompt_stats(cfg, samples)
    if not needs_current_logprobs(cfg):
        return {}
    # Entropy Advantage needs H at the current parameters, which the recompute did not keep.
    use_old = at_old_policy and cfg.entropy_adv.coef == 0
    current = {} if use_old else probe()
    if not is_last_stage:
        return {}
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "old", "adv", "pid", "ent")}
    for mb in plan.micro_batches:
        for i, n in zip(mb.sample_index, mb.resp_lens):
            s = samples[i]
            if s.old_logprobs is None:
                raise ValueError(f"sample {i} has no old_logprobs: run the old-log-prob recompute "
                                 "(OldLogprobs.fill) first")
            old = s.old_logprobs[:n].float()
            lp, ent = (old, torch.zeros(n)) if use_old else current[i]
            parts["lp"].append(lp.float())
            parts["old"].append(old)
            parts["adv"].append(torch.full((n,), float(s.advantage)))
            parts["pid"].append(torch.full((n,), s.prompt_index, dtype=torch.long))
            parts["ent"].append(ent.float())
    flat = {k: (torch.cat(v) if v else torch.zeros(0, dtype=torch.long if k == "pid" else torch.float32))
            for k, v in parts.items()}
    flat = {k: v.to(device) for k, v in flat.items()}
    prompts = sorted({s.prompt_index for s in samples})  # same list on every rank
    tokens = LossInputs(logprobs=flat["lp"], old_logprobs=flat["old"], advantages=flat["adv"],
                        mask=torch.ones_like(flat["lp"], dtype=torch.bool),
                        num_tokens_global=plan.num_tokens_global, prompt_ids=flat["pid"],
                        entropy=None if use_old else flat["ent"])
    stats, lambdas = mini_batch_stats(cfg, tokens, prompts, dp_group=dp_group)
    for mb in plan.micro_batches:
        for i in mb.sample_index:
            if lambdas:
                samples[i].group_stats[LAMBDA_KEY] = lambdas[samples[i].prompt_index]
    return stats
