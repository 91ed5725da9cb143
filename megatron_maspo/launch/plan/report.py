"""The human-readable report of one plan (``maspo plan``)."""

from __future__ import annotations

from megatron_maspo.launch.plan.types import Plan


def format_plan(plan: Plan, title: str = "") -> str:
    """A human-readable report of one plan."""
    lay = plan.layout
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    lines = [f"{title}world={plan.world} tp={lay.tp} pp={lay.pp}{cp} ep={lay.ep} dp={plan.dp} vpp={lay.vpp} "
             f"recompute={lay.recompute} distributed_optimizer={lay.distributed_optimizer} "
             f"vllm_tp={lay.vllm_tp}"]
    if plan.memory:
        m = plan.memory
        lines.append(f"  memory/GPU GiB: weights {m.weights:.1f}  grads {m.grads:.1f}  optimizer "
                     f"{m.optimizer:.1f}  activations {m.activations:.1f}  logprob-chunk {m.logprob:.2f}  "
                     f"engine {m.engine:.1f}  reserve {m.reserve:.1f}"
                     + (f"  reference {m.reference:.1f}" if m.reference else ""))
        quad = f"{m.attention:.1f} GiB [S, S] mask/scores/probs" if m.attention else "linear (in activations)"
        lines.append(f"  attention ({m.attention_backend}): {quad}")
        order = " -> ".join(f"{ph} {g:.1f}" for ph, g in m.rollout_trace)
        lines.append(f"  rollout phases GiB (trainer order): {order}")
        lines.append(f"  peak GiB: train {m.train_peak:.1f}  rollout {m.rollout_peak:.1f} ({m.rollout_peak_phase})  "
                     f"-> {m.peak:.1f}; KV pool holds {plan.kv_seqs} full-length sequences per engine")
        if m.offloaded:
            cats = "  ".join(f"{c} {g:.1f}" for c, g in m.offloaded.items())
            lines.append(f"  offloaded during generation GiB/GPU: {cats}; pinned host memory {m.host:.1f} GiB "
                         f"per GPU ({m.host * plan.gpus_per_node:.0f} GiB per node)")
    if plan.time:
        t = plan.time
        offload = (f"  offload {t.offload:.1f}" if t.offload else "") + (f"  grading {t.grading:.1f}"
                                                                         if t.grading else "")
        lines.append(f"  step s: generation {t.generation:.0f}  old-logprob {t.old_logprob:.0f}  update "
                     f"{t.update:.0f}  sync {t.sync:.1f}{offload}  total {t.total:.0f}")
        fleet = plan.fleet.describe(plan.prompts_per_step) if plan.fleet else "1 engine (no fleet layout)"
        lines.append(f"  rollout fleet (as the trainer builds it): {fleet}; longest response {plan.tail:.0f} tokens")
        lines.append(f"  weight sync: transport {plan.transport}, buckets of {plan.bucket_mb:g} MiB")
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  REFUSED: {r}" for r in plan.reasons] or ["  fits"]
    return "\n".join(lines)


def format_pool_plan(plan, title: str = "") -> str:
    """A human-readable report of one disaggregated split (``launch/plan/disagg.py::PoolPlan``)."""
    lay = plan.layout
    cp = f" cp={lay.cp}" if lay.cp > 1 else ""
    engines = plan.pools.num_engines if plan.pools else plan.engine_ranks // max(1, lay.vllm_tp)
    lines = [f"{title}world={plan.world}: training pool {plan.trainer_world} GPUs (tp={lay.tp} pp={lay.pp}{cp} "
             f"ep={lay.ep} dp={plan.dp} recompute={lay.recompute} distributed_optimizer={lay.distributed_optimizer}), "
             f"rollout pool {plan.engine_ranks} GPUs ({engines} {plan.engine_kind} engine(s) of TP {lay.vllm_tp})"]
    if plan.memory and plan.engine:
        m, e = plan.memory, plan.engine
        lines.append(f"  training GPU GiB: weights {m.weights:.1f}  grads {m.grads:.1f}  optimizer {m.optimizer:.1f}  "
                     f"activations {m.activations:.1f}  logprob-chunk {m.logprob:.2f}  reserve {m.reserve:.1f}"
                     + (f"  reference {m.reference:.1f}" if m.reference else "")
                     + f"; peak train {m.train_peak:.1f}, sync {m.rollout_peak:.1f} (no engine, nothing offloaded)")
        frac = (f"; rollout.vllm_gpu_memory_utilization up to {plan.engine_fraction_max:.2f} fits"
                if plan.engine_fraction_max is not None else "")
        owners = max(1, plan.gpus_per_node // max(1, lay.vllm_tp))
        host = (f"; staged sync in host memory {e.host:.1f} GiB per engine owner ({e.host * owners:.0f} GiB per "
                "full node)" if e.host else "")
        lines.append(f"  engine GPU GiB: engine {e.share:.1f} (weights {e.weights:.1f})  staged sync {e.staged:.1f}  "
                     f"buckets {e.buckets:.1f}  reserve {e.reserve:.1f} -> peak {e.peak:.1f}; KV pool holds "
                     f"{plan.kv_seqs} full-length sequences per engine{host}{frac}")
    if plan.time:
        t = plan.time
        lines.append(f"  rollout pool s/batch: generation {t.generation:.0f}  grading {t.grading:.1f}  apply sync "
                     f"{t.apply:.1f}  = {t.engine_side:.0f}")
        lines.append(f"  training pool s/step: old-logprob {t.old_logprob:.0f}  update {t.update:.0f}  export "
                     f"{t.export:.1f}  broadcast {t.broadcast:.1f} ({plan.link} {plan.link_gb_s:g} GB/s)  "
                     f"= {t.trainer_side:.0f}")
        if plan.pools:
            lines.append(f"  weight transfer ({plan.pools.sync_senders}): {len(plan.pools.sender_ranks)} sender(s), "
                         f"largest sender share {plan.sender_share:.2f} of the sync; planned sync {t.sync:.1f} s "
                         f"(slowest link: every engine owner's in-link takes one whole copy)")
        how = "max of the pools: they overlap" if t.staleness >= 1 else "sum of the pools: k = 0 takes turns"
        lines.append(f"  step s: {t.total:.0f} at k={t.staleness} ({how}; the {t.bound} pool bounds it); "
                     f"{t.total_at(0):.0f} at k=0; longest response {plan.tail:.0f} tokens")
    if plan.pool_size:
        lines.append(f"  {format_pool_size(plan.pool_size)}")
    if plan.pools:
        lines.append(f"  pools (as the job builds them): {plan.pools.describe(plan.prompts_per_step)}")
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  REFUSED: {r}" for r in plan.reasons] or ["  fits"]
    return "\n".join(lines)


def format_pool_size(size) -> str:
    """One line on the fewest engines the step runs with (``launch/plan/disagg.py::PoolSize``)."""
    head = (f"rollout pool: {size.engines} engine{'s' if size.engines != 1 else ''}; minimum {size.min_engines} (step {size.min_step_s:.1f} s, "
            f"within {size.slack:.0%}")
    if size.fewer_step_s is None:
        return head + f" of {size.step_s:.1f} s)"
    return head + (f"; with {size.min_engines - 1} the step is {size.fewer_step_s:.1f} s instead of "
                   f"{size.step_s:.1f} s, {size.fewer_bound}-bound)")


def format_comparison(cmp, *, table: bool = False) -> str:
    """Colocated vs the best disaggregated split (``launch/plan/split.py``); ``table``: every split."""
    col, k = cmp.colocated, cmp.staleness
    col_s = f"{col.time.total:.0f} s" if col.time and col.fits else "refused"
    lines = [f"placement: colocated step {col_s} on {col.world} GPUs"]
    best = cmp.best
    if best is None:
        lines.append(f"  no disaggregated split of {col.world} GPUs fits")
    else:
        p, sets = best
        t = p.time
        verdict = (f"{cmp.speedup:.2f}x colocated: disaggregated is faster" if cmp.speedup and cmp.speedup > 1
                   else "colocated is faster" if cmp.speedup else "colocated does not fit")
        lines.append(f"  best disaggregated split at k={k}: {p.engine_ranks} engine GPUs + {p.trainer_world} "
                     f"training GPUs, step {t.total:.0f} s (rollout {t.engine_side:.0f}, training "
                     f"{t.trainer_side:.0f}), {verdict}; {t.total_at(0):.0f} s at k=0")
        lines.append("  use: " + (" ".join(f"--set {o}" for o in sets) or "(this config)"))
        if cmp.in_flight is not None and cmp.in_flight[0].time is not None:
            f = cmp.in_flight[0].time
            lines.append(f"  with rollout.in_flight_updates=true (the straggler tail overlaps the next batch): "
                         f"step {f.total:.0f} s (rollout {f.engine_side:.0f}, training {f.trainer_side:.0f})")
    if table:
        lines.append(f"  {'R':>3} {'T':>3} {'engines':>7} {'rollout s':>9} {'training s':>10} {f'step k={k}':>9} "
                     f"{'step k=0':>8} {'peak GiB train/engine':>21}  verdict")
        laid = [p for p, _ in cmp.splits if p.time is not None]
        for p in laid:
            t, eng = p.time, p.pools.num_engines if p.pools else 0
            peaks = f"{p.memory.peak:.1f}/{p.engine.peak:.1f}"
            lines.append(f"  {p.engine_ranks:>3} {p.trainer_world:>3} {eng:>7} {t.engine_side:>9.0f} "
                         f"{t.trainer_side:>10.0f} {t.total:>9.0f} {t.total_at(0):>8.0f} {peaks:>21}  "
                         + ("fits" if p.fits else "refused: " + p.reasons[0]))
        unlaid = [p for p, _ in cmp.splits if p.time is None]
        if unlaid:
            lines.append(f"  {len(unlaid)} other split(s) refused by the pools' layout, e.g. R={unlaid[0].engine_ranks}: "
                         f"{unlaid[0].reasons[0]}")
    return "\n".join(lines)
