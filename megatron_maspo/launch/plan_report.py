"""The human-readable report of one plan (``maspo plan``)."""

from __future__ import annotations

from megatron_maspo.launch.plan_types import Plan


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
    lines += [f"  REFUSED: {r}" for r in plan.reasons] or ["  fits"]
    return "\n".join(lines)
