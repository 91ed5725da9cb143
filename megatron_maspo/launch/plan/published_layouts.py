"""The planner on the layouts published 2026 runs use for DeepSeek-V3 and Qwen3-235B-A22B (issue 56).

Source: the NeMo RL v0.4 performance summary (``docs/about/performance-summary.md`` of the NeMo RL
repository, "Nemo RL v0.4" table: DGX-H100, bf16 training and generation, Megatron training, GRPO on
OpenMathInstruct-2, 512 samples per step, one optimizer step per step). It publishes the GPU count, both
layouts, the longest training sequence, the average generated length and the total step time; each row
is planned with that and the shared assumptions of the calibration tables (150-token prompts, a reference
model), nothing tuned. Our own assumptions per row: trainer state offloaded during a colocated rollout,
full recompute, the engine's memory share (``ENGINE_SHARE``). Rows without a published time are the
layouts the issue asks for beside them (``measured=None``).

    python -m megatron_maspo.launch.plan.published_layouts   # the table of docs/performance-model.md
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_maspo.launch.plan.calibration import BASE_RECIPE, PROMPT_MEAN, SHARED

OFFLOAD = ("train.offload_params=true", "train.offload_grads=true", "train.offload_optimizer=true")
ONE_OFF = ("rollout.placement=disaggregated", "rollout.max_staleness=1", "loss.tis_cap=2.0",
           "train.offload_params=false", "train.offload_grads=false", "train.offload_optimizer=false")
"""One-step-off: engines on GPUs of their own, one version behind, truncated importance sampling."""

ENGINE_SHARE = {"colocated": 0.6, "disaggregated": 0.85}
"""``rollout.vllm_gpu_memory_utilization`` we assume (the summary does not state it): colocated the
engine shares the GPU with the trainer's resident parameters; one-step-off its GPU is its own."""

DSV3 = ("model.arch=deepseek-v3", "parallel.tp=1", "parallel.pp=16", "parallel.ep=16", "parallel.pp_first_layers=1",
        "rollout.vllm_tp=32", "train.prompts_per_step=16", "train.mini_batches_per_step=1",
        "rollout.max_new_tokens=1024", "train.max_tokens_per_micro_batch=2048", "model.recompute=full")
"""DeepSeek-V3: training [TP 1, CP 1, EP 16, PP 16] (61 layers: 1 + 15 x 4), generation TP 32 (four nodes),
1,536-token sequences (512 prompt + 1,024 response)."""

Q235 = ("model.arch=qwen3-235b-a22b", "parallel.tp=2", "parallel.cp=2", "parallel.pp=8", "parallel.ep=16",
        "parallel.pp_first_layers=11", "parallel.pp_last_layers=11", "model.attention_backend=te",
        "rollout.vllm_tp=16", "train.prompts_per_step=16", "train.mini_batches_per_step=1",
        "rollout.max_new_tokens=7680", "train.max_tokens_per_micro_batch=4096", "model.recompute=full")
"""Qwen3-235B-A22B: training [TP 2, CP 2, EP 16, PP 8] (94 layers: 11 + 6 x 12 + 11), generation TP 16
(two nodes), 8,192-token sequences; the micro-batch budget is per CP rank."""

Q235_OFF = ("parallel.tp=4", "parallel.cp=1", "rollout.vllm_tp=8", "train.max_tokens_per_micro_batch=8192")
"""The summary's one-step-off Qwen3-235B row: training [TP 4, CP 1, EP 16, PP 8], generation TP 8."""


@dataclass(frozen=True)
class LayoutRun:
    """One published (or asked-for) layout: how to plan it and its published step time."""

    name: str
    nodes: int
    sets: tuple[str, ...]
    response_mean: float
    measured: float | None

    @property
    def placement(self) -> str:
        return "disaggregated" if "rollout.placement=disaggregated" in self.sets else "colocated"

    def overrides(self) -> list[str]:
        """``--set`` values of the run (``maspo plan qwen25_7b_maspo --nodes N --gpus-per-node 8 ...``)."""
        share = f"rollout.vllm_gpu_memory_utilization={ENGINE_SHARE[self.placement]}"
        return [f"parallel.world_size={self.nodes * 8}", *SHARED, share, *self.sets]


RUNS = (
    LayoutRun("DeepSeek-V3, 256 GPUs, colocated, G-TP 32", 32, (*DSV3, *OFFLOAD), 745, 154),
    LayoutRun("DeepSeek-V3, 512 GPUs, colocated, G-TP 32", 64, (*DSV3, *OFFLOAD), 745, None),
    LayoutRun("DeepSeek-V3, 512 GPUs, one-step-off 256 + 256, G-TP 32", 64,
              (*DSV3, *ONE_OFF, "rollout.engine_ranks=256"), 744, 77.9),
    LayoutRun("Qwen3-235B-A22B, 128 GPUs, colocated, G-TP 16", 16, (*Q235, *OFFLOAD), 5671, 506),
    LayoutRun("Qwen3-235B-A22B, 256 GPUs, one-step-off 128 + 128, T-TP 4 CP 1, G-TP 8", 32,
              (*Q235, *Q235_OFF, *ONE_OFF, "rollout.engine_ranks=128"), 5691, 241),
    LayoutRun("Qwen3-235B-A22B, 256 GPUs, one-step-off 128 + 128, G-TP 16", 32,
              (*Q235, *ONE_OFF, "rollout.engine_ranks=128"), 5691, None),
)


def plan_run(run: LayoutRun):
    """The planner's plan of ``run`` (``Plan`` colocated, ``PoolPlan`` one-step-off): the ``maspo plan`` path."""
    from megatron_maspo.launch.plan.disagg import estimate_disaggregated
    from megatron_maspo.launch.plan.estimator import arch_of, estimate, layout_of
    from megatron_maspo.launch.plan.types import Assumptions
    from megatron_maspo.recipes.registry import resolve_config

    cfg = resolve_config(BASE_RECIPE, None, run.overrides())
    hw = Assumptions(prompt_mean=PROMPT_MEAN, response_mean=run.response_mean)
    est = estimate_disaggregated if run.placement == "disaggregated" else estimate
    return est(cfg, arch_of(cfg), layout_of(cfg), nodes=run.nodes, gpus_per_node=8, hw=hw)


def table(runs: tuple[LayoutRun, ...] = RUNS) -> str:
    """Markdown: per run, whether it fits, its peak GiB per GPU, the planned phases and the step against
    the published one."""
    rows = ["| run | fits | peak GiB | generation s | sync s | train s | step planned/published s (ratio) |",
            "|---|---|---|---|---|---|---|"]
    for run in runs:
        p = plan_run(run)
        t = p.time
        sync = t.sync + getattr(t, "apply", 0.0)
        peak = p.peak_gb if hasattr(p, "peak_gb") else p.memory.peak
        step = f"{t.total:.0f}/-" if run.measured is None else f"{t.total:.0f}/{run.measured:g} ({t.total / run.measured:.2f})"
        rows.append(f"| {run.name} | {'yes' if p.fits else 'no: ' + '; '.join(p.reasons)} | {peak:.1f} | "
                    f"{t.generation:.0f} | {sync:.0f} | {t.old_logprob + t.update:.0f} | {step} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
