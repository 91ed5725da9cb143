"""The Megatron-Core actor: the MASPO training step over TP x PP x DP (x EP) and its log-probs.

One rollout step (loss-formulas.md §0.3) is :meth:`MegatronActor.train_step`:

1. trim over-long / empty responses (counted), split the samples into ``mini_batches_per_step``
   mini-batches by prompt, and plan each one (:mod:`packing`): the same plan on every rank;
2. recompute ``log π_old`` (and ``log π_ref`` when a KL term is on) with **the same** packing and
   micro-batches as training, so ``ρ = 1`` exactly on the first mini-batch (``check_first_ratio``).
   With a single mini-batch the weights cannot move before it is trained, so ``log π_old`` *is* the
   training forward's own log-prob: the recompute is skipped and its detached value used instead,
   unless ``check_first_ratio`` asks for the check (both paths: :mod:`old_logprobs`);
3. per mini-batch: Megatron's pipeline schedule with the fused hidden→log-prob forward
   (:mod:`forward`), exact global token-mean via ``calculate_per_token_loss``, one all-reduce of
   the "all finite?" flag, then AdamW + clipping + LR schedule, or a skipped step on NaN/inf.

Every rank receives the identical global list of samples (the trainer broadcasts the rollout);
each builds tensors only for its DP shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.inputs import LossInputs
from megatron_maspo.loss.metrics import finalize_metrics, reduce_metrics
from megatron_maspo.loss.policy import compute_policy_loss
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.model.packed_attention import build_packed_seq_params
from megatron_maspo.model.provider import build_model_chunks, loaded_weights_options
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.parallel.device import default_device
from megatron_maspo.parallel.groups import ParallelGroups
from megatron_maspo.train.actor.batch_stats import prepare_batch_stats
from megatron_maspo.train.actor.cp_split import (
    cp_share,
    local_micro_batch,
    select_tokens,
    unsplit_tokens,
)
from megatron_maspo.train.actor.forward import (
    MicroBatchInputs,
    StepContext,
    hidden_output,
    make_forward_step,
    unwrap,
)
from megatron_maspo.train.actor.inference import actor_build_options
from megatron_maspo.train.actor.moe_metrics import RouterMonitor
from megatron_maspo.train.actor.offload import StateOffloader, offload_categories, training_tensors
from megatron_maspo.train.actor.old_logprobs import OldLogprobs
from megatron_maspo.train.actor.optimizer import build_optimizer, grads_finite, overlap_options
from megatron_maspo.train.actor.packing import (
    MiniBatchPlan,
    PackedMicroBatch,
    PackStats,
    block_causal_mask,
    cu_seqlens,
    plan_mini_batch,
    split_mini_batches,
    token_inputs,
    trim_lengths,
)
from megatron_maspo.train.actor.routing_replay import RoutingReplay
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import OptimConfig, TrainConfig

logger = logging.getLogger(__name__)


class MegatronActor:
    """Policy (and optional frozen reference) Megatron-Core model with its optimizer.

    Args:
        spec: the architecture.
        groups: this rank's parallel groups (``init_parallel`` already ran with ``parallel``'s sizes).
        model, parallel, optim, loss, train: the config sections the actor reads (precision and
            attention; layout; AdamW and schedule; the policy loss; step shape and budgets).
        temperature: the rollout sampling temperature τ (log-probs are taken of ``logits / τ``).
        init_weights: called as ``init_weights(chunks)`` on the unwrapped GPTModel chunks before DDP
            wrapping, e.g. ``partial(load_hf_weights, spec=spec, groups=groups, source=dir)``;
            None keeps Megatron's seeded initialisation.
        memory_phase: ``memory_phase(name)`` context that meters a phase's memory peak (the trainer's
            :class:`~megatron_maspo.train.observe.memory.PhaseMemory`); None meters nothing.
    """

    def __init__(self, spec: ArchSpec, groups: ParallelGroups, *, model: ModelConfig,
                 parallel: ParallelConfig, optim: OptimConfig, loss: LossConfig, train: TrainConfig,
                 temperature: float = 1.0, init_weights: Callable[[list], None] | None = None,
                 memory_phase: Callable[[str], contextlib.AbstractContextManager] | None = None) -> None:
        p = parallel
        if (groups.tp, groups.pp, groups.ep, groups.cp) != (p.tp, p.pp, p.ep, p.cp):
            raise ValueError(f"parallel groups (tp={groups.tp}, pp={groups.pp}, ep={groups.ep}, "
                             f"cp={groups.cp}) do not match parallel (tp={p.tp}, pp={p.pp}, ep={p.ep}, "
                             f"cp={p.cp})")
        self.spec, self.groups = spec, groups
        self.model_cfg, self.parallel_cfg = model, parallel
        self.loss_cfg, self.train_cfg, self.temperature = loss, train, temperature
        self.device = default_device()
        self.opts = actor_build_options(model, parallel, spec)  # shared with the inference-only policy
        # loaded weights replace the random ones: skip the full CPU draw (model/provider.py)
        build_opts = self.opts if init_weights is None else loaded_weights_options(self.opts)
        chunks = build_model_chunks(spec, build_opts, pp_rank=groups.pp_rank)
        for c in chunks:
            # packed rows differ in length: PP stages exchange shapes first
            c.config.variable_seq_lengths = p.pp > 1
        if init_weights is not None:
            init_weights(chunks)
        self.reference: list | None = None
        if train.reference_model or loss.kl_coef > 0:
            # A fresh build + state copy: deepcopy fails on the process groups the modules hold.
            self.reference = build_model_chunks(spec, loaded_weights_options(self.opts), pp_rank=groups.pp_rank)
            for ref, c in zip(self.reference, chunks):
                ref.config.variable_seq_lengths = p.pp > 1
                ref.load_state_dict(c.state_dict())
                ref.eval().requires_grad_(False)
        total = train.steps * train.mini_batches_per_step
        self.overlap = overlap_options(p, cuda=self.device.type == "cuda")
        bundle = build_optimizer(chunks, optim, total_steps=total, bf16=model.bf16, fp16=model.fp16,
                                 distributed_optimizer=p.distributed_optimizer, **self.overlap)
        self.chunks, self.optimizer, self.scheduler = bundle.chunks, bundle.optimizer, bundle.scheduler
        self.moe_monitor = RouterMonitor(self.chunks, num_layers=spec.num_layers) if spec.is_moe else None
        self.replay_mode = model.routing_replay
        if self.replay_mode != "off" and not spec.is_moe:
            raise ValueError(f"model.routing_replay={self.replay_mode!r} needs an MoE model")
        self.replay = (RoutingReplay(self.chunks, moe_layers=[i for i in range(spec.num_layers) if spec.is_moe_layer(i)])
                       if self.replay_mode != "off" else None)
        # Megatron's allgather MoE dispatcher (CPU at EP > 1) needs equal row lengths over the EP group
        self._equal_rows = p.ep > 1 and getattr(
            chunks[0].config, "moe_token_dispatcher_type", None) == "allgather"
        self.steps_done = 0
        self.steps_skipped = 0
        # The per-phase memory meter (the trainer's), and the offloader of this actor's training state,
        # which must be resident before any forward/backward or export (offloaded storages are empty).
        self.phase: Callable[[str], contextlib.AbstractContextManager] = (
            memory_phase if memory_phase is not None else lambda name: contextlib.nullcontext())
        self.offloader = StateOffloader(
            partial(training_tensors, self.chunks, self.optimizer, self.reference or ()),
            enabled=offload_categories(train.offload_params, train.offload_grads, train.offload_optimizer),
            device=self.device)
        self._logprob_hook: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # π_old of each step: recomputed through logprobs_local, or the training forward's
        self.old_logprobs = OldLogprobs(self)

    # ------------------------------------------------------------------ planning
    def _packing(self) -> tuple[int, dict]:
        """(trim length, ``plan_mini_batch`` keywords) of this actor's layout.

        At ``cp > 1`` the budget counts tokens per CP rank: a row holds ``budget·cp`` tokens, each
        sequence padded to a multiple of ``2·cp`` (and the row, with sequence parallelism, to a
        multiple of ``cp·tp`` so the local row splits over TP).
        """
        cp, tp = self.groups.cp, self.groups.tp
        m = 2 * cp if cp > 1 else 1
        budget = self.train_cfg.max_tokens_per_micro_batch * cp
        row = cp * tp if self.opts.sequence_parallel else 1
        row = row * m // math.gcd(row, m)  # lcm: filler segments stay multiples of 2·cp
        return budget // m * m, dict(dp=self.groups.dp, dp_rank=self.groups.dp_rank, budget=budget,
                                     equal_rows=self._equal_rows, row_multiple=row, seq_multiple=m)

    def plan(self, samples: Sequence[Sample]) -> tuple[list[MiniBatchPlan], list[int], PackStats]:
        """Mini-batch plans of this rank, trained response lengths and packing counters."""
        trim, kw = self._packing()
        resp_lens, stats = trim_lengths(samples, trim)
        minis = split_mini_batches(samples, self.train_cfg.mini_batches_per_step)
        plans = [plan_mini_batch(samples, idx, resp_lens, **kw) for idx in minis]
        return plans, resp_lens, stats

    def plan_one(self, samples: Sequence[Sample]) -> MiniBatchPlan:
        """One mini-batch holding every sample (the SFT warm start), packed for this layout."""
        trim, kw = self._packing()
        resp_lens, _ = trim_lengths(samples, trim)
        return plan_mini_batch(samples, list(range(len(samples))), resp_lens, **kw)

    def _inputs(self, samples: Sequence[Sample], mb: PackedMicroBatch) -> MicroBatchInputs:
        dev = self.device
        per_token = {k: (None if t is None else t.to(dev))
                     for k, t in token_inputs(samples, mb).items()}
        n_tok = torch.tensor(mb.resp_lens, dtype=torch.long)
        grp = {k: torch.repeat_interleave(torch.tensor([float(samples[i].group_stats[k]) for i in mb.sample_index],
                                                       dtype=torch.float32), n_tok)
               for k in sorted({k for i in mb.sample_index for k in samples[i].group_stats})}
        share = None
        if self.groups.cp > 1:  # this CP rank's rows and the response tokens it predicts
            share = cp_share(mb, self.groups.cp, self.groups.cp_rank)
            mb = local_micro_batch(mb, share)
            per_token, grp = select_tokens(per_token, share), select_tokens(grp, share)
        dense = self.opts.attention_backend == "dense_mask"
        return MicroBatchInputs(
            group_stats={k: v.to(dev) for k, v in grp.items() if v is not None},
            tokens=mb.tokens.view(1, -1).to(dev), position_ids=mb.position_ids.view(1, -1).to(dev),
            attention_mask=block_causal_mask(mb.seq_lens, dev) if dense else None,
            packed_seq_params=None if dense else build_packed_seq_params(cu_seqlens(mb.seq_lens), dev),
            resp_index=mb.resp_index.to(dev),
            labels=mb.labels.to(dev), loss_mask=mb.loss_mask.to(dev), seq_ids=mb.seq_ids.to(dev),
            num_tokens=int(mb.loss_mask.sum()) if share is not None else mb.num_tokens,
            cp_share=share, **{k: (None if t is None else t.to(dev)) for k, t in per_token.items()})

    # ------------------------------------------------------------------ schedule
    def _run(self, chunks: list, inputs: list[MicroBatchInputs], ctx: StepContext,
             forward_only: bool, replay: list | None = None) -> None:
        """One Megatron schedule over ``inputs``; ``replay`` = per-input routing targets
        (``train/actor/routing_replay.py``), armed on the routers right before each forward."""
        seq = max(int(x.tokens.shape[1]) for x in inputs)
        its = ([self.replay.iterate(c, inputs, replay, self.device) for c in range(len(chunks))]
               if replay is not None and self.replay is not None else [iter(inputs) for _ in chunks])
        data = its if len(chunks) > 1 else its[0]
        try:
            with hidden_output(chunks):
                get_forward_backward_func()(
                    forward_step_func=make_forward_step(ctx), data_iterator=data,
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(inputs),
                    seq_length=seq, micro_batch_size=1, forward_only=forward_only)
        finally:
            if replay is not None and self.replay is not None:
                self.replay.clear()
        if self.groups.cp > 1 and ctx.logprobs:  # last stage: every CP rank gets the whole [T]
            g = self.groups.cp_group
            ctx.logprobs = [unsplit_tokens(v, x.cp_share, g) for v, x in zip(ctx.logprobs, inputs)]
            ctx.entropies = [unsplit_tokens(v, x.cp_share, g) for v, x in zip(ctx.entropies, inputs)]

    def _replay_targets(self, samples: Sequence[Sample], plan: MiniBatchPlan, on: bool) -> list | None:
        if not on or self.replay is None:
            return None
        return [self.replay.targets(samples, mb) for mb in plan.micro_batches]

    def _context(self) -> StepContext:
        return StepContext(tp_group=self.groups.tp_group, vocab_size=self.spec.vocab_size,
                           temperature=self.temperature,
                           chunk_bytes=self.train_cfg.logprob_chunk_bytes,
                           logprob_kernel=self.train_cfg.logprob_kernel,
                           sequence_parallel=self.opts.sequence_parallel)

    def logprobs_local(self, samples: Sequence[Sample], plans: list[MiniBatchPlan], *, model: str,
                       replay: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
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
                          forward_only=True,
                          replay=self._replay_targets(samples, plan, replay and model == "policy"))
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
        self._require_resident()
        plans, _, _ = self.plan(samples)
        local = self.logprobs_local(samples, plans, model=model)
        g = self.groups
        mine = local if (g.is_last_stage and g.tp_rank == 0) else {}
        parts = comm.all_gather_object(mine)
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
        comm.all_reduce(both, op=comm.ReduceOp.MAX)
        if not torch.equal(both[:3], -both[3:]):
            raise ValueError("ranks received different rollout batches; every rank must get the "
                             "identical global list of samples")

    def _loss_fn(self, plan: MiniBatchPlan, stats: dict[str, torch.Tensor], mb: MicroBatchInputs,
                 lp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Inside Megatron's schedule nothing may raise on one rank alone: non-finite inputs are masked
        # and counted here; optimizer_step agrees on the count over all ranks, then raises or skips.
        lcfg = self.loss_cfg if self.loss_cfg.nonfinite == "mask" else \
            dataclasses.replace(self.loss_cfg, nonfinite="mask")
        if self._logprob_hook is not None:  # fault injection (MASPO_FAULT kind=nan) for this step
            lp = self._logprob_hook(lp, mb.loss_mask.bool())
        inputs = LossInputs(
            logprobs=lp, old_logprobs=self.old_logprobs.for_loss(mb.old_logprobs, lp),
            advantages=mb.advantages, mask=mb.loss_mask, num_tokens_global=plan.num_tokens_global,
            num_seqs_global=plan.num_seqs_global, seq_ids=mb.seq_ids, prompt_ids=mb.prompt_ids,
            entropy=ent, ref_logprobs=mb.ref_logprobs, rollout_logprobs=mb.rollout_logprobs,
            batch_stats={**stats, **mb.group_stats})
        return compute_policy_loss(lcfg, inputs, dp_group=self.groups.dp_cp_group)

    def forward_backward(self, samples: Sequence[Sample], plan: MiniBatchPlan) -> StepContext:
        """Zero the grads, run one mini-batch forward+backward; grads end DP-reduced and ÷N_glob."""
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats = prepare_batch_stats(  # whole-group / whole-mini-batch statistics (BAPO, QUATRO)
            self.loss_cfg, samples, plan, at_old_policy=self.old_logprobs.at_old_policy,
            probe=lambda: self.logprobs_local(samples, [plan], model="policy"),
            is_last_stage=self.groups.is_last_stage, dp_group=self.groups.dp_group, device=self.device)
        ctx = self._context()
        ctx.loss_fn, ctx.batch_stats = partial(self._loss_fn, plan, stats), stats
        ctx.num_tokens_global = plan.num_tokens_global
        self._run(self.chunks, [self._inputs(samples, mb) for mb in plan.micro_batches], ctx,
                  forward_only=False, replay=self._replay_targets(samples, plan, self.replay_mode == "all"))
        return ctx

    def optimizer_step(self, ctx: StepContext) -> dict[str, float]:
        """Step if loss, grads and loss inputs are finite on **every** rank, else skip on every rank.

        One MAX all-reduce of (non-finite loss/grad, non-finite loss inputs) decides for all ranks, so
        ``loss.nonfinite='raise'`` raises on every rank together (a raise on one rank alone would leave
        the others waiting in their next collective), and ``'skip'`` skips the step everywhere.
        """
        mode = self.loss_cfg.nonfinite
        bad_inputs = float(ctx.metrics.get("loss/nonfinite_tokens", 0.0)) if mode != "mask" else 0.0
        # fp16: an overflowing gradient is the loss scaler's to handle (optimizer.step skips, scale backs off)
        grads_ok = self.model_cfg.fp16 or grads_finite(self.chunks)
        flags = torch.tensor([0.0 if (ctx.loss_finite and grads_ok) else 1.0, bad_inputs])
        comm.all_reduce(flags, op=comm.ReduceOp.MAX)
        if mode == "raise" and flags[1] > 0:
            raise FloatingPointError(
                f"non-finite log-probs/advantages at {int(flags[1])} valid token(s) on some rank in "
                f"optimizer step {self.steps_done} (loss.nonfinite='raise'; 'skip' skips such steps, "
                "'mask' drops the tokens)")
        if flags.max() > 0:
            logger.warning("non-finite loss, gradient or loss input on some rank: optimizer step %d "
                           "skipped on rank %d", self.steps_done, torch.distributed.get_rank()
                           if torch.distributed.is_initialized() else 0)
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.steps_skipped += 1
            return {"actor/step_skipped": 1.0}
        ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        self.steps_done += 1
        self.old_logprobs.at_old_policy = False
        return {"actor/step_skipped": 0.0 if ok else 1.0, "actor/grad_norm": float(grad_norm or 0.0),
                "actor/lr": float(lr)}

    def _reduce_metrics(self, local: dict[str, torch.Tensor]) -> dict[str, float]:
        """SUM (MIN/MAX for extremes) over DP x CP on the last stage (each CP rank summed its own
        tokens), then broadcast over PP."""
        g = self.groups
        out: dict[str, float] = {}
        if g.is_last_stage and local:
            reduced = finalize_metrics(reduce_metrics(local, g.dp_cp_group))
            out = {k: float(v) for k, v in reduced.items()}
        if g.pp > 1:
            out = comm.broadcast_object(out, src=torch.distributed.get_global_rank(g.pp_group, g.pp - 1),
                                        group=g.pp_group)
        return out

    def train_step(self, samples: Sequence[Sample], *,
                   progress: Callable[[int], None] | None = None,
                   logprob_hook: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   ) -> dict[str, float]:
        """All mini-batches (optimizer steps) of one rollout step; ``progress(1)`` after each one.

        ``logprob_hook(logprobs [T], mask [T]) -> logprobs``: applied to the training forward's log-probs
        during this step only (fault injection: :class:`~megatron_maspo.train.process.faults.FaultInjector`).

        Returns:
            metrics averaged over mini-batches (loss-module keys, ``actor/loss``, ``actor/grad_norm``,
            ``actor/lr``) plus counters ``actor/truncated``, ``actor/empty``, ``actor/steps_skipped``
            and ``actor/first_ratio_max_abs_dev``; ``actor/loss_mb{k}`` per mini-batch.

        Raises:
            RuntimeError: ``train.check_first_ratio`` and ``max |log ρ| > 1e-6`` on mini-batch 0.
        """
        self._require_resident()
        self._check_same_batch(samples)
        self._logprob_hook = logprob_hook
        try:
            return self._train_step(samples, progress)
        finally:
            self._logprob_hook = None

    def _train_step(self, samples: Sequence[Sample], progress: Callable[[int], None] | None) -> dict[str, float]:
        plans, _, stats = self.plan(samples)
        for c in self.chunks:
            c.train()
        reuse = self.old_logprobs.reuses_forward(plans)
        with self.phase("old_logprobs"):
            self.old_logprobs.fill(samples, plans, policy=not reuse)
        sums: dict[str, float] = {}
        out: dict[str, float] = {"actor/truncated": float(stats.truncated),
                                 "actor/truncated_tokens": float(stats.truncated_tokens),
                                 "actor/empty": float(stats.empty)}
        skipped = 0
        for k, plan in enumerate(plans):
            if progress is not None and k > 0:
                progress(1)
            if plan.num_tokens_global == 0:
                logger.warning("mini-batch %d has no trainable token; skipped", k)
                skipped += 1
                continue
            ctx = self.forward_backward(samples, plan)
            if k == 0:  # ρ = 1 check (or, reusing the forward, its log-probs kept as π_old)
                out["actor/first_ratio_max_abs_dev"] = self.old_logprobs.after_first_forward(
                    samples, plan, ctx, reused=reuse)
            step = self.optimizer_step(ctx)
            skipped += int(step["actor/step_skipped"])
            metrics = {**self._reduce_metrics(ctx.metrics), **step}
            out[f"actor/loss_mb{k}"] = metrics.get("actor/loss", float("nan"))
            for key, v in metrics.items():
                sums[key] = sums.get(key, 0.0) + v
        if self.overlap["overlap_param_gather"]:
            # the last step's all-gather would wait for the next forward: finish it now, so weight
            # sync and checkpoints read updated parameters (earlier mini-batches keep the overlap)
            for c in self.chunks:
                c.start_param_sync(force_sync=True)
        if progress is not None and plans:
            progress(1)
        n = max(len(plans), 1)
        out.update({k: v / n for k, v in sums.items() if k != "actor/step_skipped"})
        out["actor/steps_skipped"] = float(skipped)
        if self.moe_monitor is not None:
            out.update(self.moe_monitor.collect(self.groups.tp))
        if self.replay is not None:
            out["moe/replay_missing_mb"], self.replay.missing = float(self.replay.missing), 0
        return out

    def named_modules_unwrapped(self) -> list:
        """The GPTModel chunks under DDP (for export and checkpointing): their parameters must be on the
        GPU (the sync runs with the gradients and optimizer state offloaded)."""
        self._require_resident(("params",))
        return [unwrap(c) for c in self.chunks]

    def _require_resident(self, categories: tuple[str, ...] | None = None) -> None:
        """Raise if any of ``categories`` (None = any) of the training state is on the host."""
        off = self.offloader
        if off is not None and off.offloaded and (categories is None or set(categories) & off.offloaded_categories):
            raise RuntimeError(f"the actor's training state ({', '.join(sorted(off.offloaded_categories))}) is "
                               "offloaded to host memory: reload it first")

    def require_resident(self) -> None:
        """Raise unless the whole training state is on the device (a checkpoint reads all of it)."""
        self._require_resident()
