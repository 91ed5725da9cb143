"""Qwen3-235B-A22B (235 B total, 22 B active) MASPO layout: 32 nodes x 8 H100 (80 GB), TP 4 x PP 2 x EP 32 (DP 32;
94 layers split 47 + 47; four experts per GPU and layer, expert DP 4), vLLM at TP 8 per node with FP8 weights.

Why this shape (``maspo plan qwen3_235b_a22b_maspo --nodes 32``; docs/moe.md has the figures):

- **The engine.** A bf16 engine is 54.7 GiB per GPU at TP 8. Woken on top of the trainer's resident state
  (35.8 GiB), the colocated rollout peaks at 94 GiB, more than an H100 holds. vLLM's online FP8
  (``rollout.vllm_quantization="fp8"``, docs/fp8-rollout.md) makes it 27.5 GiB, a 66.8 GiB peak, with 44
  full 9k-token sequences of KV per engine at 0.6 of the GPU. The price is sampling from a quantised policy,
  corrected with truncated importance sampling (``loss.tis_cap=2``).
- **Keeping bf16 engines.** Put them on GPUs of their own:
  ``--set rollout.placement=disaggregated --set rollout.engine_ranks=64 --set rollout.max_staleness=1
  --set rollout.vllm_quantization=null ...``, as ``maspo plan`` prints. That is a one-step-off run, 1.27x
  the colocated FP8 step in the planner.
- **The trainer.** TP 4 inside a node with sequence parallelism (on by default for MoE), PP 2 (94 = 2 x 47
  is the only even split under 47 stages), EP 32 across 4 nodes. The trainer's state goes to the host
  during generation (``train.offload_*``).
- The router is softmax top-8 with normalised probabilities and has no correction bias. Routing replay is
  off, as in every recipe.

    maspo plan qwen3_235b_a22b_maspo --nodes 32 --splits
    maspo check qwen3_235b_a22b_maspo       # 64 distinct ranks at full size on the meta device, ~25 s
    maspo launch qwen3_235b_a22b_maspo --executor slurm --nodes 32 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import FP8_ENGINES_OFFLOADED, paper_config, with_settings

NAME = "qwen3-235b-a22b-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/Qwen3-235B-A22B", arch="qwen3-235b-a22b", alpha=0.3, nodes=32,
                       tp=4, pp=2, ep=32, recompute="full", vllm_tp=8, vllm_gpu_memory_utilization=0.6)
    return with_settings(cfg, FP8_ENGINES_OFFLOADED)
