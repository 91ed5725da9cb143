"""The planner against published RL step splits: each run as a ``maspo plan`` command and its ratios.

The runs are the NeMo-RL v0.3 release blog's Megatron-backend GRPO runs (H100-80G, bf16, vLLM rollouts,
64 prompts x 32 samples per step, a KL reference model). The blog gives the model, GPU count, training
layout, maximum length, mean response length and the measured seconds per phase; everything else
(vLLM TP, prompt length, micro-batch budget) is our assumption and is stated in ``SHARED`` / each run.
``HELD_OUT`` (NeMo RL v0.4 step times), ``LONG_BUDGET`` (verl 7B 28k, no published response length) and
``LONG_HELD_OUT`` (1.5B / 7B at 28k with published response lengths) are the other tables of
docs/planner-calibration.md.

    python -m megatron_maspo.launch.plan.calibration      # prints the tables of docs/planner-calibration.md
    python -m megatron_maspo.launch.plan.calibration --exponential-tail   # the rejected tail model
    python -m megatron_maspo.launch.plan.calibration --controller-gb-s 0.8   # with NeMo-RL's data shipping
"""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("update", "sync", "generation", "old_logprob", "total")
"""Planner phases compared; the blog's names: train, refit, generation, log-prob, step."""

BASE_RECIPE = "qwen25_7b_maspo"
"""Any recipe works as the base: every field that matters is overridden below."""

PROMPT_MEAN = 150
"""Assumed mean prompt tokens (a math problem in a chat template); the blog does not state it."""

SHARED = ("train.prompts_per_step=64", "rollout.group_size=32", "train.mini_batches_per_step=1",
          "train.reference_model=true", "rollout.vllm_gpu_memory_utilization=0.45",
          "parallel.distributed_optimizer=true", "data.max_prompt_tokens=512", "model.recompute=null")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: how to plan it, and its measured phase seconds."""

    name: str
    nodes: int
    sets: tuple[str, ...]
    response_mean: float
    measured: dict[str, float]
    """Seconds per phase under the planner's names (PHASES)."""
    response_max: float | None = None
    shared: tuple[str, ...] = SHARED
    """Options every run of its source shares."""
    hardware: tuple[tuple[str, float], ...] = ()
    """``maspo plan`` hardware options (``--gpu-mem-gb`` ...) as (Assumptions field, value); none: H100."""
    prompt_mean: float = PROMPT_MEAN

    def argv(self) -> list[str]:
        """``maspo plan`` arguments reproducing this run."""
        out = [BASE_RECIPE, "--nodes", str(self.nodes), "--gpus-per-node", "8"]
        for field, value in self.hardware:
            out += [_HW_FLAGS[field], str(value)]
        for s in (*self.shared, *self.sets):
            out += ["--set", s]
        out += ["--prompt-mean", str(self.prompt_mean), "--response-mean", str(self.response_mean)]
        if self.response_max is not None:
            out += ["--response-max", str(self.response_max)]
        return out


def _m(step: float, train: float, refit: float, gen: float, lp: float) -> dict[str, float]:
    return {"total": step, "update": train, "sync": refit, "generation": gen, "old_logprob": lp}


RUNS = (
    PublishedRun("Llama-3.1-8B-Instruct, 8 GPUs", 1,
                 ("model.arch=llama3.1-8b", "parallel.tp=2", "rollout.vllm_tp=1",
                  "rollout.max_new_tokens=3584", "train.max_tokens_per_micro_batch=4096"),
                 795, _m(112, 28, 5, 58, 18)),
    PublishedRun("Llama-3.1-70B, 64 GPUs, TP4 PP4", 8,
                 ("model.arch=llama3.1-70b", "rollout.vllm_gpu_memory_utilization=0.6", "parallel.tp=4", "parallel.pp=4", 
                  "rollout.vllm_tp=4", "rollout.max_new_tokens=3584", "train.max_tokens_per_micro_batch=4096"),
                 398, _m(147, 28, 14, 84, 18)),
    PublishedRun("Qwen3-30B-A3B, 64 GPUs, EP8 TP2", 8,
                 ("model.arch=qwen3-30b-a3b", "parallel.tp=1", "parallel.ep=8", "rollout.vllm_tp=2",
                  "rollout.max_new_tokens=3584", "train.max_tokens_per_micro_batch=4096"),
                 3251, _m(167, 50, 12, 78, 23)),
    PublishedRun("Qwen3-32B, 64 GPUs, TP4 PP2", 8,
                 ("model.arch=qwen3-32b", "parallel.tp=4", "parallel.pp=2", 
                  "rollout.vllm_tp=4", "rollout.max_new_tokens=3584", "train.max_tokens_per_micro_batch=4096"),
                 3283, _m(213, 68, 7, 96, 40)),
    PublishedRun("Llama-3.3-70B, 128 GPUs, CP4, 16k", 16,  # TP4 PP4, no recompute: NeMo-RL v0.3.0's 70B config
                 ("model.arch=llama3.3-70b", "rollout.vllm_gpu_memory_utilization=0.6", "parallel.tp=4", "parallel.pp=4",
                  "parallel.cp=4", "model.attention_backend=te",
                  "rollout.vllm_tp=4", "rollout.max_new_tokens=15872",
                  "train.max_tokens_per_micro_batch=4096"),  # per CP rank: rows of 16k
                 749, _m(445, 64, 17, 287, 75)),
)


HELD_OUT = (
    PublishedRun("Llama-3.1-8B, 16 GPUs (held out)", 2,
                 ("model.arch=llama3.1-8b", "parallel.tp=1", "rollout.vllm_tp=1", "train.mini_batches_per_step=4",
                  "rollout.max_new_tokens=3584", "train.max_tokens_per_micro_batch=4096"),
                 1060, {"total": 97.7}),
    PublishedRun("Qwen3-30B-A3B, 32 GPUs (held out)", 4,
                 ("model.arch=qwen3-30b-a3b", "parallel.tp=1", "parallel.ep=8", "rollout.vllm_tp=4",
                  "train.mini_batches_per_step=4", "rollout.max_new_tokens=3584",
                  "train.max_tokens_per_micro_batch=4096"),
                 3154, {"total": 225}),
    PublishedRun("Qwen3-32B, 32 GPUs (held out)", 4,
                 ("model.arch=qwen3-32b", "parallel.tp=4", "parallel.pp=4", "rollout.vllm_tp=4",
                  "train.mini_batches_per_step=4", "rollout.max_new_tokens=3584",
                  "train.max_tokens_per_micro_batch=4096"),
                 3206, {"total": 393}),
)
"""Runs not used to choose any constant: the NeMo RL v0.4 performance summary's on-policy GRPO runs
(DGX-H100, bf16, Megatron training, vLLM generation, OpenMathInstruct-2; 2,048 samples per step trained
as 4 optimizer steps of 512). It publishes the step time only, so only ``total`` is compared; their
ratios are reported as they come out (docs/planner-calibration.md), not held to the band."""


_HW_FLAGS = {"gpu_mem_gb": "--gpu-mem-gb", "peak_tflops": "--peak-tflops", "hbm_tb_s": "--hbm-tb-s"}

H20 = (("gpu_mem_gb", 95.0), ("peak_tflops", 148.0), ("hbm_tb_s", 4.0))
"""NVIDIA H20: 96 GB HBM3 (95 GiB usable), 148 TFLOP/s dense bf16, 4.0 TB/s."""

VERL_7B_28K = ("model.arch=qwen2.5-7b", "train.prompts_per_step=512", "rollout.group_size=16",
               "train.mini_batches_per_step=16", "train.reference_model=false", "loss.kl_coef=0",
               "rollout.vllm_gpu_memory_utilization=0.8", "rollout.vllm_tp=4", "data.max_prompt_tokens=2048",
               "rollout.max_new_tokens=28672", "train.max_tokens_per_micro_batch=30720", "model.recompute=full",
               "parallel.tp=1", "parallel.distributed_optimizer=true", "train.offload_params=true",
               "train.offload_grads=true", "train.offload_optimizer=true")
"""verl's colocated synchronous DAPO baseline of ``docs/advance/fully_async.md`` (volcengine/verl, read at
commit 2147009822388b70cda46ab4a27c5400d3d113ed and again at b178a3cd56f5, where the 32-GPU row's
update_actor reads 269.80 s since 15a9b0f58a8b) with the script of
``recipe/fully_async_policy/exp/qwen2-7B-math/fsdp2_colocate/dapo_7b_math_fsdp2_colocate.sh`` (commit
5a85685bf472): Qwen2.5-Math-7B (the qwen2.5-7b shape), 512 prompts x 16, mini-batches of 32 prompts,
2k prompt / 28k response budgets, vLLM TP 4 at 0.80, FSDP2 with parameter and optimizer offload, gradient
checkpointing, no KL (so no reference model). The FSDP2 trainer is planned as Megatron TP 1 with the
distributed optimizer (both shard the state over all ranks); its Ulysses SP 4 is not modelled."""

LONG_BUDGET_RESPONSE_MEAN = 825
"""The doc publishes no response length. The mean is the one input fitted: on the 32-GPU row's update
phase (the trainer's FLOP time at the planner's MFU: 270 planned vs 269.80 s measured at 825 tokens),
and used unchanged for the other two rows, which run the same recipe. (Fitted at 1,000 tokens on 313.81 s
before verl corrected that cell to 269.80 s in commit 15a9b0f58a8b: 313.81 s is the update of the
fully_async 16:16 row below it.)"""

LONG_BUDGET = (
    PublishedRun("Qwen2.5-Math-7B, 32 H20, 28k (fitted)", 4, VERL_7B_28K, LONG_BUDGET_RESPONSE_MEAN,
                 {"total": 790.10, "generation": 357.41, "old_logprob": 107.71, "update": 269.80},
                 shared=(), hardware=H20),
    PublishedRun("Qwen2.5-Math-7B, 64 H20, 28k (held out)", 8, VERL_7B_28K, LONG_BUDGET_RESPONSE_MEAN,
                 {"total": 365.28, "generation": 150.72, "old_logprob": 70.26, "update": 133.41},
                 shared=(), hardware=H20),
    PublishedRun("Qwen2.5-Math-7B, 128 H20, 28k (held out)", 16, VERL_7B_28K, LONG_BUDGET_RESPONSE_MEAN,
                 {"total": 356.30, "generation": 177.85, "old_logprob": 53.92, "update": 113.81},
                 shared=(), hardware=H20),
)
"""Long-budget small-model rows: verl's colocated sync runs, averaged over 400 steps (step, gen,
old_log_prob, update_actor; the doc's own wandb source). Reported as they come out, not held to the band
(docs/planner-calibration.md says why)."""


_BOBA_28K = ("data.max_prompt_tokens=1024", "rollout.max_new_tokens=27648", "train.mini_batches_per_step=4",
             "model.recompute=full", "parallel.distributed_optimizer=true", "train.offload_params=true",
             "train.offload_grads=true", "train.offload_optimizer=true")
"""Shared by the rows of RLinf's "Comparison with VeRL" page: boba math prompts (<= 1,024 tokens), 28,672-token
context (27,648-token responses), GRPO with 16 samples per prompt, 4 optimizer steps a step, trainer state
offloaded during generation, activation recompute (RLinf: 20 of 28 blocks; verl: gradient checkpointing)."""

RLINF_1P5B = ("model.arch=r1-distill-qwen-1.5b", "train.prompts_per_step=32", "rollout.group_size=16",
              "rollout.vllm_tp=1", "rollout.vllm_gpu_memory_utilization=0.55",
              "train.max_tokens_per_micro_batch=28672", *_BOBA_28K)
"""DeepSeek-R1-Distill-Qwen-1.5B on 1 x 8 H100, 512 sequences a step (the page's "Batch Size Per DP 128" x
DP 4; its RLinf gen throughput x 8 GPUs x gen time / mean length gives 512.0), engine TP 1 at 0.55 (RLinf's
``qwen2.5-1.5b-grpo-megatron.yaml`` at d7161199a); trainer TP 2 (RLinf) or FSDP with Ulysses SP 2 (verl,
planned at TP 1: the planner's times depend on TP only through the GEMM width)."""

VERL_7B_BOBA = ("model.arch=r1-distill-qwen-7b", "train.prompts_per_step=128", "rollout.group_size=16",
                "rollout.vllm_tp=2", "rollout.vllm_gpu_memory_utilization=0.4", "parallel.tp=1",
                "train.max_tokens_per_micro_batch=30000", "train.reference_model=true", *_BOBA_28K)
"""The page's verl script (``ds_7b_fsdp_sglang``, 8 x 8 GPUs): DeepSeek-R1-Distill-Qwen-7B, 128 prompts x 16,
SGLang TP 2 at 0.4, FSDP (planned as TP 1 with the distributed optimizer; Ulysses SP 4 not modelled) with
parameter and optimizer offload, gradient checkpointing, dynamic batches of 30,000 tokens per GPU, a KL loss
(0.001), so a reference model."""

LONG_HELD_OUT = (
    PublishedRun("R1-Distill-Qwen-1.5B, 8 H100, 28k, verl (held out)", 1,
                 (*RLINF_1P5B, "parallel.tp=1", "train.reference_model=true"), 14254.84,
                 {"total": 363.55, "generation": 260.92, "update": 66.53}, shared=()),
    PublishedRun("R1-Distill-Qwen-1.5B, 8 H100, 28k, RLinf (held out)", 1,
                 (*RLINF_1P5B, "parallel.tp=2", "train.reference_model=false", "loss.kl_coef=0"), 13975.0,
                 {"total": 346.33, "generation": 266.08, "old_logprob": 17.78, "update": 61.12}, shared=()),
    PublishedRun("R1-Distill-Qwen-7B, 64 GPUs, 28k, verl (held out)", 8, VERL_7B_BOBA, 10425.77,
                 {"total": 447.36, "generation": 325.09, "old_logprob": 21.58 + 20.74, "update": 73.01},
                 shared=()),
)
"""Long-budget small-model runs with a published mean response length, none used to choose any constant:
RLinf's "Comparison with VeRL" page (RLinf/RLinf ``docs/source-en/rst_source/resources/blog/
compare_with_verl.rst``, read at a3816b596478; https://rlinf.readthedocs.io/en/latest/rst_source/resources/
blog/compare_with_verl.html). The 1.5B rows are its rendered table (verl v0.5.0 8fdc4d3 and RLinf, Aug 2025;
verl's prev-logprob 17.51 s excludes its reference pass, which the planner folds into old_logprob, so that
cell is not compared); the 7B row is the page's verl measurement kept in an RST comment (verl f252da3, July
2025; old_logprob = old_log_prob 21.58 + ref 20.74 s). Prompts: 150 tokens (``PROMPT_MEAN``; verl's gen
throughput x 8 x gen time / 512 exceeds its mean response by 150). Held to the band by the test."""


MEASURED_CONTROLLER_GB_S = 0.8
"""Controller (de)serialisation rate measured on the development machine (one AMD EPYC vCPU) by
``python -m megatron_maspo.launch.plan.dispatch``: 0.69-0.81 GB/s over several runs. Used only for the
comparison with NeMo-RL's single-controller data shipping (docs/planner-calibration.md), not in ``RUNS``."""


def planned(run: PublishedRun, exponential_tail: bool = False,
            controller_gb_s: float | None = None) -> dict[str, float]:
    """The planner's seconds per phase for ``run`` (the same path as ``maspo plan``).

    ``exponential_tail``: instead of the budget, take as tail the expected longest of each engine's
    responses were their lengths exponential with the published mean (the comparison in the docs).
    ``controller_gb_s``: add a single controller's data shipping at this rate (launch/plan/dispatch.py).
    """
    from megatron_maspo.launch.plan.estimator import arch_of, estimate, layout_of
    from megatron_maspo.launch.plan.rollout import exponential_expected_max
    from megatron_maspo.launch.plan.types import Assumptions
    from megatron_maspo.recipes.registry import resolve_config

    world = run.nodes * 8
    cfg = resolve_config(BASE_RECIPE, None, [f"parallel.world_size={world}", *run.shared, *run.sets])
    tail = run.response_max
    if exponential_tail:
        per_engine = -(-cfg.train.prompts_per_step * cfg.rollout.group_size // (world // cfg.rollout.vllm_tp))
        tail = exponential_expected_max(run.response_mean, per_engine)
    hw = Assumptions(prompt_mean=run.prompt_mean, response_mean=run.response_mean, response_max=tail,
                     controller_gb_s=controller_gb_s, **dict(run.hardware))
    plan = estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=run.nodes, gpus_per_node=8, hw=hw)
    assert plan.time is not None, plan.reasons
    t = plan.time
    return {"update": t.update, "sync": t.sync, "generation": t.generation, "old_logprob": t.old_logprob,
            "grading": t.grading, "total": t.total}


def _cell(got: float, measured: float | None) -> str:
    return f"{got:.0f}/-" if measured is None else f"{got:.0f}/{measured:.0f} ({got / measured:.2f})"


def table(exponential_tail: bool = False, runs: tuple[PublishedRun, ...] = RUNS,
          controller_gb_s: float | None = None) -> str:
    """Markdown: per run, planner seconds / measured seconds per phase (``-``: not published)."""
    head = "| run | " + " | ".join(f"{p} planned/measured s (ratio)" for p in PHASES) + " |"
    rows = [head, "|" + "---|" * (len(PHASES) + 1)]
    for run in runs:
        got = planned(run, exponential_tail, controller_gb_s)
        cells = [_cell(got[p], run.measured.get(p)) for p in PHASES]
        rows.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    gb_s = float(argv[argv.index("--controller-gb-s") + 1]) if "--controller-gb-s" in argv else None
    print(table(exponential_tail="--exponential-tail" in argv, controller_gb_s=gb_s))
    if "--exponential-tail" not in argv:
        print()
        print(table(runs=HELD_OUT, controller_gb_s=gb_s))
        print()
        print(table(runs=LONG_BUDGET, controller_gb_s=gb_s))
        print()
        print(table(runs=LONG_HELD_OUT, controller_gb_s=gb_s))
