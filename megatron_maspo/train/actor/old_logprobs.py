"""``log π_old`` (and ``log π_ref``) of a rollout step's samples: recomputed, or the forward's own.

The loss's ratio ``ρ = π_θ / π_old`` needs the log-probs of the policy the step starts from, in
the packing the training forward uses, so that ``ρ = 1`` exactly on the first mini-batch
(``train.check_first_ratio``). :class:`OldLogprobs` decides how to get them and holds the two flags
the actor's training step reads:

- **recompute** (:meth:`OldLogprobs.fill`): one forward-only pass of the policy (and of the frozen
  reference when a KL term is on) over the step's plans, before any optimizer step; the results go
  to ``Sample.old_logprobs`` / ``Sample.ref_logprobs`` on the last pipeline stage;
- **reuse** (:meth:`OldLogprobs.reuses_forward`): with a single mini-batch the weights cannot move
  before it is trained, so ``log π_old`` *is* the training forward's own log-prob; the recompute is
  skipped, the loss takes the forward's detached value (:meth:`OldLogprobs.for_loss`) and the
  forward's log-probs are stored afterwards for the trainer's mismatch diagnostics.

The actor owns one instance (``MegatronActor.old_logprobs``) and lends it its forward-only pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.group_stats import needs_current_logprobs
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.groups import ParallelGroups
from megatron_maspo.train.actor.forward import StepContext
from megatron_maspo.train.actor.packing import MiniBatchPlan
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import TrainConfig

FIRST_RATIO_TOL = 1e-6
"""Largest ``max |log ρ|`` on the first mini-batch that ``train.check_first_ratio`` accepts."""


class LogprobSource(Protocol):
    """What :class:`OldLogprobs` reads from its actor (read on every call: the SFT warm start and
    tests swap ``loss_cfg`` / ``replay_mode`` on a built actor)."""

    loss_cfg: LossConfig
    train_cfg: TrainConfig
    groups: ParallelGroups
    replay_mode: str
    replay: Any
    """The routing-replay recorder, or None without replay."""

    def logprobs_local(self, samples: Sequence[Sample], plans: list[MiniBatchPlan], *,
                       model: str, replay: bool = False
                       ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Forward-only ``{sample: ([L'] log-prob, [L'] entropy)}`` of this DP shard (last stage)."""
        ...


class OldLogprobs:
    """The old-log-prob recompute of one actor, and whether the parameters still equal π_old's.

    Attributes:
        from_forward: this step reuses the training forward's log-probs as π_old (the samples'
            ``old_logprobs`` are None until :meth:`store_forward` fills them).
        at_old_policy: the parameters still equal π_old's (no optimizer step since :meth:`fill`);
            BAPO / QUATRO statistics then use the recomputed log-probs as they are.
    """

    def __init__(self, source: LogprobSource) -> None:
        self.source = source
        self.from_forward = False
        self.at_old_policy = False

    def reuses_forward(self, plans: list[MiniBatchPlan]) -> bool:
        """True when the recompute provably equals the training forward (one mini-batch: no
        optimizer step between them), ``train.check_first_ratio`` does not ask to verify it and no
        mini-batch statistic (BAPO's bounds, QUATRO's dual ascent) needs π_old before the
        forward."""
        src = self.source
        return (len(plans) == 1 and not src.train_cfg.check_first_ratio
                and not needs_current_logprobs(src.loss_cfg)
                and src.replay_mode != "old_logprobs")  # the training forward does not replay

    def fill(self, samples: Sequence[Sample], plans: list[MiniBatchPlan], *,
             policy: bool = True) -> None:
        """Recompute ``old_logprobs`` (if ``policy``) and ``ref_logprobs`` (if a KL term is on) for
        this rank's samples; without ``policy`` the old ones are cleared (the training forward's are
        used).

        Collective: every rank calls it with the same plans (every PP stage joins the schedule).
        """
        src = self.source
        want_ref = src.loss_cfg.kl_coef > 0
        self.from_forward = not policy
        if not policy:
            for s in samples:
                s.old_logprobs = None
        for name, which, needed in (("old_logprobs", "policy", policy),
                                    ("ref_logprobs", "reference", want_ref)):
            if needed:  # always: every PP stage must join the schedule, whatever the samples hold
                kw = {"replay": True} if which == "policy" and src.replay is not None else {}
                for i, (lp, _) in src.logprobs_local(samples, plans, model=which, **kw).items():
                    setattr(samples[i], name, lp)
        self.at_old_policy = True

    def for_loss(self, old: torch.Tensor | None, logprobs: torch.Tensor) -> torch.Tensor | None:
        """The ``[T]`` π_old a loss call takes: the micro-batch's ``old`` or, when this step reuses
        the forward and none was recomputed, the forward's own ``logprobs`` detached."""
        if old is None and self.from_forward:  # one mini-batch: π_old is this very forward
            return logprobs.detach()
        return old

    def store_forward(self, samples: Sequence[Sample], plan: MiniBatchPlan,
                      ctx: StepContext) -> None:
        """``old_logprobs`` of this rank's samples from the training forward (last stage only);
        later forwards need a recompute again (the optimizer step moves the weights)."""
        self.from_forward = False
        for mb, lp in zip(plan.micro_batches, ctx.logprobs):
            for i, part in zip(mb.sample_index, lp.cpu().split(mb.resp_lens)):
                samples[i].old_logprobs = part

    def first_ratio_dev(self, samples: Sequence[Sample], plan: MiniBatchPlan,
                        ctx: StepContext) -> float:
        """``max |log π_θ - log π_old|`` over the first mini-batch's forward, MAX-reduced over all
        ranks (one all-reduce; 0 on ranks without the last stage before it)."""
        dev = torch.zeros(1, dtype=torch.float64)
        if self.source.groups.is_last_stage:
            for mb, lp in zip(plan.micro_batches, ctx.logprobs):
                if mb.num_tokens:
                    old = torch.cat([samples[i].old_logprobs for i in mb.sample_index])
                    dev = torch.maximum(dev, (lp.cpu().double() - old.double()).abs().max().view(1))
        comm.all_reduce(dev, op=comm.ReduceOp.MAX)
        return float(dev)

    def after_first_forward(self, samples: Sequence[Sample], plan: MiniBatchPlan,
                            ctx: StepContext, *, reused: bool) -> float:
        """``actor/first_ratio_max_abs_dev`` of the step's first mini-batch: 0 when its forward was
        π_old (its log-probs are stored for diagnostics), else the measured deviation.

        Raises:
            RuntimeError: ``train.check_first_ratio`` and a deviation above ``FIRST_RATIO_TOL``.
        """
        if reused:  # ρ = 1 by construction; keep the old log-probs for diagnostics
            self.store_forward(samples, plan, ctx)
            return 0.0
        dev = self.first_ratio_dev(samples, plan, ctx)
        if self.source.train_cfg.check_first_ratio and dev > FIRST_RATIO_TOL:
            raise RuntimeError(f"first mini-batch |log ρ| max = {dev:.3e} > {FIRST_RATIO_TOL}: "
                               "old-log-prob recompute and training forward differ")
        return dev
