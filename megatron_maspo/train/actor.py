"""The Megatron-Core actor: log-prob recompute and the MASPO training step over TP x PP x DP (x EP).

One rollout step (algorithms.md §0.3) is :meth:`MegatronActor.train_step`:

1. trim over-long / empty responses (counted), split the samples into ``mini_batches_per_step``
   mini-batches by prompt, and plan each one (:mod:`packing`): the same plan on every rank;
2. recompute ``log π_old`` (and ``log π_ref`` when a KL term is on) with **the same** packing and
   micro-batches as training, so ``ρ = 1`` exactly on the first mini-batch (``check_first_ratio``);
3. per mini-batch: Megatron's pipeline schedule with the fused hidden→log-prob forward
   (:mod:`forward`), exact global token-mean via ``calculate_per_token_loss``, one all-reduce of
   the "all finite?" flag, then AdamW + clipping + LR schedule, or a skipped step on NaN/inf.

Every rank receives the identical global list of samples (the trainer broadcasts the rollout);
each builds tensors only for its DP shard.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_maspo.config import MaspoConfig
from megatron_maspo.loss.metrics import finalize_metrics, reduce_metrics
from megatron_maspo.loss.policy import compute_policy_loss
from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.cpu_compat import spoof_tensor_type
from megatron_maspo.parallel.groups import ParallelGroups, default_device
from megatron_maspo.train.batch_stats import prepare_batch_stats
from megatron_maspo.train.forward import (
    MicroBatchInputs,
    StepContext,
    hidden_output,
    make_forward_step,
    unwrap,
)
from megatron_maspo.train.optimizer import build_optimizer, grads_finite
from megatron_maspo.train.packing import (
    MiniBatchPlan,
    PackedMicroBatch,
    PackStats,
    block_causal_mask,
    plan_mini_batch,
    split_mini_batches,
    trim_lengths,
)
from megatron_maspo.train.samples import Sample

logger = logging.getLogger(__name__)

FIRST_RATIO_TOL = 1e-6


class MegatronActor:
    """Policy (and optional frozen reference) Megatron-Core model with its optimizer.

    Args:
        cfg: the root config (model precision, parallel layout, loss, optim, train, rollout τ).
        spec: the architecture.
        groups: this rank's parallel groups (``init_parallel`` already ran with cfg.parallel sizes).
        init_weights: called as ``init_weights(chunks)`` on the unwrapped GPTModel chunks before DDP
            wrapping, e.g. ``partial(load_hf_weights, spec=spec, groups=groups, source=dir)``;
            None keeps Megatron's seeded initialisation.
    """

    def __init__(self, cfg: MaspoConfig, spec: ArchSpec, groups: ParallelGroups, *,
                 init_weights: Callable[[list], None] | None = None) -> None:
        p = cfg.parallel
        if (groups.tp, groups.pp, groups.ep) != (p.tp, p.pp, p.ep):
            raise ValueError(f"parallel groups (tp={groups.tp}, pp={groups.pp}, ep={groups.ep}) do not "
                             f"match cfg.parallel (tp={p.tp}, pp={p.pp}, ep={p.ep})")
        self.cfg, self.spec, self.groups = cfg, spec, groups
        self.device = default_device()
        self.opts = ModelBuildOptions(
            tp=p.tp, pp=p.pp, ep=p.ep, vpp=p.vpp, bf16=cfg.model.bf16, recompute=cfg.model.recompute,
            make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
            calculate_per_token_loss=True,
            # Packed rows rely on an explicit block-causal mask, which the local spec honours. TE's
            # attention needs thd PackedSeqParams for packing instead; until that path is wired and
            # tested, the actor always builds the local spec (TE remains available to other callers).
            use_te=False)
        chunks = build_model_chunks(spec, self.opts, pp_rank=groups.pp_rank)
        for c in chunks:
            # packed rows differ in length: PP stages exchange shapes first
            c.config.variable_seq_lengths = p.pp > 1
        if init_weights is not None:
            init_weights(chunks)
        self.reference: list | None = None
        if cfg.train.reference_model or cfg.loss.kl_coef > 0:
            self.reference = [copy.deepcopy(c).eval() for c in chunks]
            for c in self.reference:
                c.requires_grad_(False)
        total = cfg.train.steps * cfg.train.mini_batches_per_step
        bundle = build_optimizer(chunks, cfg.optim, total_steps=total, bf16=cfg.model.bf16,
                                 distributed_optimizer=p.distributed_optimizer)
        self.chunks, self.optimizer, self.scheduler = bundle.chunks, bundle.optimizer, bundle.scheduler
        # Megatron's allgather MoE dispatcher (CPU at EP > 1) needs equal row lengths over the EP group
        self._equal_rows = p.ep > 1 and getattr(
            chunks[0].config, "moe_token_dispatcher_type", None) == "allgather"
        self.steps_done = 0
        self.steps_skipped = 0
        self._at_old_policy = False  # parameters still equal π_old's (ρ = 1): set by the recompute

    # ------------------------------------------------------------------ planning
    def plan(self, samples: Sequence[Sample]) -> tuple[list[MiniBatchPlan], list[int], PackStats]:
        """Mini-batch plans of this rank, trained response lengths and packing counters."""
        budget = self.cfg.train.max_tokens_per_micro_batch
        resp_lens, stats = trim_lengths(samples, budget)
        minis = split_mini_batches(samples, self.cfg.train.mini_batches_per_step)
        plans = [plan_mini_batch(samples, idx, resp_lens, dp=self.groups.dp,
                                 dp_rank=self.groups.dp_rank, budget=budget,
                                 equal_rows=self._equal_rows) for idx in minis]
        return plans, resp_lens, stats

    def _inputs(self, samples: Sequence[Sample], mb: PackedMicroBatch) -> MicroBatchInputs:
        dev = self.device

        def per_token(get: Callable[[Sample, int], Any]) -> torch.Tensor | None:
            parts = []
            for i, n in zip(mb.sample_index, mb.resp_lens):
                v = get(samples[i], n)
                if v is None:
                    return None
                parts.append(torch.as_tensor(v, dtype=torch.float32).reshape(-1)[:n])
            if not parts:  # filler row: one masked token
                return torch.zeros(1)
            return torch.cat(parts)

        adv = per_token(lambda s, n: torch.full((n,), float(s.advantage)))
        pid = torch.tensor([samples[i].prompt_index for i in mb.seq_ids.tolist()] if mb.sample_index
                           else [0], dtype=torch.long)
        opt = {k: (None if t is None else t.to(dev)) for k, t in {
            "old_logprobs": per_token(lambda s, n: s.old_logprobs),
            "ref_logprobs": per_token(lambda s, n: s.ref_logprobs),
            "rollout_logprobs": per_token(lambda s, n: s.rollout_logprobs)}.items()}
        keys = {k for i in mb.sample_index for k in samples[i].group_stats}
        grp = {k: per_token(lambda s, n, k=k: torch.full((n,), float(s.group_stats[k]))).to(dev)
               for k in sorted(keys)}
        return MicroBatchInputs(
            group_stats=grp, tokens=mb.tokens.view(1, -1).to(dev), position_ids=mb.position_ids.view(1, -1).to(dev),
            attention_mask=block_causal_mask(mb.seq_lens, dev), resp_index=mb.resp_index.to(dev),
            labels=mb.labels.to(dev), loss_mask=mb.loss_mask.to(dev), seq_ids=mb.seq_ids.to(dev),
            prompt_ids=pid.to(dev), advantages=adv.to(dev), num_tokens=mb.num_tokens, **opt)

    # ------------------------------------------------------------------ schedule
    def _run(self, chunks: list, inputs: list[MicroBatchInputs], ctx: StepContext,
             forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq = max(int(x.tokens.shape[1]) for x in inputs)
        data = [iter(inputs) for _ in chunks] if len(chunks) > 1 else iter(inputs)
        with hidden_output(chunks):
            get_forward_backward_func()(
                forward_step_func=make_forward_step(ctx), data_iterator=data,
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(inputs),
                seq_length=seq, micro_batch_size=1, forward_only=forward_only)

    def _context(self) -> StepContext:
        return StepContext(tp_group=self.groups.tp_group, vocab_size=self.spec.vocab_size,
                           temperature=self.cfg.rollout.temperature,
                           chunk_size=self.cfg.train.logprob_chunk_size)

    def _logprobs_local(self, samples: Sequence[Sample], plans: list[MiniBatchPlan], *,
                        model: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``{sample: ([L'] log-prob, [L'] entropy)}`` for this DP shard, on the last stage only."""
        if model not in ("policy", "reference"):
            raise ValueError(f"model={model!r}; accepted: 'policy', 'reference'")
        if model == "reference" and self.reference is None:
            raise ValueError("no reference model: set train.reference_model=True (or loss.kl_coef > 0)")
        chunks = self.chunks if model == "policy" else self.reference
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for plan in plans:
                ctx = self._context()
                self._run(chunks, [self._inputs(samples, mb) for mb in plan.micro_batches], ctx,
                          forward_only=True)
                for mb, lp, ent in zip(plan.micro_batches, ctx.logprobs, ctx.entropies):
                    for i, part_lp, part_ent in zip(mb.sample_index, lp.cpu().split(mb.resp_lens),
                                                    ent.cpu().split(mb.resp_lens)):
                        out[i] = (part_lp, part_ent)
        return out

    def compute_logprobs(self, samples: Sequence[Sample], *, model: str = "policy"
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sample ``[L']`` fp32 log-probs and entropies (empty for skipped samples), on every rank.

        Uses the training packing (so it equals the old-log-prob recompute bit for bit). The
        last-stage TP-rank-0 results are all-gathered as objects: a diagnostics path, not the one
        ``train_step`` uses (which keeps everything local).
        """
        plans, _, _ = self.plan(samples)
        local = self._logprobs_local(samples, plans, model=model)
        g = self.groups
        mine = local if (g.is_last_stage and g.tp_rank == 0) else {}
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        merged = {k: v for d in parts for k, v in d.items()}
        empty = torch.zeros(0)
        return ([merged.get(i, (empty, empty))[0] for i in range(len(samples))],
                [merged.get(i, (empty, empty))[1] for i in range(len(samples))])

    # ------------------------------------------------------------------ training
    def _check_same_batch(self, samples: Sequence[Sample]) -> None:
        """One MIN/MAX all-reduce proving every rank got the same rollout (else the plan differs)."""
        fp = torch.tensor([len(samples), sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
                           sum(s.response_ids[0] if s.response_ids else 0 for s in samples)],
                          dtype=torch.float64)
        both = torch.cat([fp, -fp])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if not torch.equal(both[:3], -both[3:]):
            raise ValueError("ranks received different rollout batches; every rank must get the "
                             "identical global list of samples")

    def _loss_fn(self, plan: MiniBatchPlan, stats: dict[str, torch.Tensor], mb: MicroBatchInputs,
                 lp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return compute_policy_loss(
            self.cfg.loss, lp, mb.old_logprobs, mb.advantages, mb.loss_mask,
            num_tokens_global=plan.num_tokens_global, num_seqs_global=plan.num_seqs_global,
            seq_ids=mb.seq_ids, entropy=ent, ref_logprobs=mb.ref_logprobs,
            rollout_logprobs=mb.rollout_logprobs, prompt_ids=mb.prompt_ids,
            dp_group=self.groups.dp_group, batch_stats={**stats, **mb.group_stats})

    def fill_old_logprobs(self, samples: Sequence[Sample], plans: list[MiniBatchPlan]) -> None:
        """Recompute ``old_logprobs`` (and ``ref_logprobs`` if needed) for this rank's samples."""
        want_ref = self.cfg.loss.kl_coef > 0
        for name, which, needed in (("old_logprobs", "policy", True),
                                    ("ref_logprobs", "reference", want_ref)):
            if needed:  # always: every PP stage must join the schedule, whatever the samples hold
                for i, (lp, _) in self._logprobs_local(samples, plans, model=which).items():
                    setattr(samples[i], name, lp)
        self._at_old_policy = True

    def forward_backward(self, samples: Sequence[Sample], plan: MiniBatchPlan) -> StepContext:
        """Zero the grads, run one mini-batch forward+backward; grads end DP-reduced and ÷N_glob."""
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = prepare_batch_stats(  # whole-group / whole-mini-batch statistics (BAPO, QUATRO)
            self.cfg.loss, samples, plan, at_old_policy=self._at_old_policy,
            probe=lambda: self._logprobs_local(samples, [plan], model="policy"),
            is_last_stage=self.groups.is_last_stage, dp_group=self.groups.dp_group, device=self.device)
        ctx = self._context()
        ctx.loss_fn, ctx.batch_stats = partial(self._loss_fn, plan, stats), stats
        ctx.num_tokens_global = plan.num_tokens_global
        self._run(self.chunks, [self._inputs(samples, mb) for mb in plan.micro_batches], ctx,
                  forward_only=False)
        return ctx

    def optimizer_step(self, ctx: StepContext) -> dict[str, float]:
        """Step if loss and grads are finite on **every** rank (one all-reduce), else skip cleanly."""
        bad = torch.tensor([0.0 if (ctx.loss_finite and grads_finite(self.chunks)) else 1.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            logger.warning("non-finite loss or gradient on some rank: optimizer step %d skipped",
                           self.steps_done)
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.steps_skipped += 1
            return {"actor/step_skipped": 1.0}
        with spoof_tensor_type():
            ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        self.steps_done += 1
        self._at_old_policy = False
        return {"actor/step_skipped": 0.0 if ok else 1.0, "actor/grad_norm": float(grad_norm or 0.0),
                "actor/lr": float(lr)}

    def _reduce_metrics(self, local: dict[str, torch.Tensor]) -> dict[str, float]:
        """SUM (MIN/MAX for extremes) over DP on the last stage, then broadcast over PP."""
        g = self.groups
        out: dict[str, float] = {}
        if g.is_last_stage and local:
            reduced = finalize_metrics(reduce_metrics(local, g.dp_group))
            out = {k: float(v) for k, v in reduced.items()}
        if g.pp > 1:
            box = [out]
            dist.broadcast_object_list(box, src=dist.get_global_rank(g.pp_group, g.pp - 1),
                                       group=g.pp_group)
            out = box[0]
        return out

    def _first_ratio_dev(self, samples: Sequence[Sample], plan: MiniBatchPlan,
                         ctx: StepContext) -> float:
        dev = torch.zeros(1, dtype=torch.float64)
        if self.groups.is_last_stage:
            for mb, lp in zip(plan.micro_batches, ctx.logprobs):
                if mb.num_tokens:
                    old = torch.cat([samples[i].old_logprobs for i in mb.sample_index])
                    dev = torch.maximum(dev, (lp.cpu().double() - old.double()).abs().max().view(1))
        dist.all_reduce(dev, op=dist.ReduceOp.MAX)
        return float(dev)

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """All mini-batches (optimizer steps) of one rollout step.

        Returns:
            metrics averaged over mini-batches (loss-module keys, ``actor/loss``, ``actor/grad_norm``,
            ``actor/lr``) plus counters ``actor/truncated``, ``actor/empty``, ``actor/steps_skipped``
            and ``actor/first_ratio_max_abs_dev``; ``actor/loss_mb{k}`` per mini-batch.

        Raises:
            RuntimeError: ``train.check_first_ratio`` and ``max |log ρ| > 1e-6`` on mini-batch 0.
        """
        self._check_same_batch(samples)
        plans, _, stats = self.plan(samples)
        for c in self.chunks:
            c.train()
        self.fill_old_logprobs(samples, plans)
        sums: dict[str, float] = {}
        out: dict[str, float] = {"actor/truncated": float(stats.truncated),
                                 "actor/truncated_tokens": float(stats.truncated_tokens),
                                 "actor/empty": float(stats.empty)}
        skipped = 0
        for k, plan in enumerate(plans):
            if plan.num_tokens_global == 0:
                logger.warning("mini-batch %d has no trainable token; skipped", k)
                skipped += 1
                continue
            ctx = self.forward_backward(samples, plan)
            if k == 0:
                dev = self._first_ratio_dev(samples, plan, ctx)
                out["actor/first_ratio_max_abs_dev"] = dev
                if self.cfg.train.check_first_ratio and dev > FIRST_RATIO_TOL:
                    raise RuntimeError(f"first mini-batch |log ρ| max = {dev:.3e} > {FIRST_RATIO_TOL}: "
                                       "old-log-prob recompute and training forward differ")
            step = self.optimizer_step(ctx)
            skipped += int(step["actor/step_skipped"])
            metrics = {**self._reduce_metrics(ctx.metrics), **step}
            out[f"actor/loss_mb{k}"] = metrics.get("actor/loss", float("nan"))
            for key, v in metrics.items():
                sums[key] = sums.get(key, 0.0) + v
        n = max(len(plans), 1)
        out.update({k: v / n for k, v in sums.items() if k != "actor/step_skipped"})
        out["actor/steps_skipped"] = float(skipped)
        return out

    def named_modules_unwrapped(self) -> list:
        """The GPTModel chunks under DDP (for export and checkpointing)."""
        return [unwrap(c) for c in self.chunks]
