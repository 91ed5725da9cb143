"""DeepSeek-V3 (671 B total, 37 B active) MASPO layout: 64 nodes x 8 H200 (141 GB), TP 8 x EP 256 (DP 64; one
routed expert per GPU and layer, expert DP 2), PP 1, vLLM at TP 8 per node with FP8 weights.

Why this shape (``maspo plan deepseek_v3_maspo``, docs/deepseek-v3.md has the figures):

- **The engine.** One bf16 copy of the model is 1.34 TB, 168 GB per GPU of an 8-GPU node: no node of 80 or
  141 GB GPUs holds it. vLLM's online FP8 (``rollout.vllm_quantization="fp8"``: linear weights in e4m3,
  quantised as each sync loads the bf16 export) halves it to 84 GB per GPU, which an H200 holds with ~31 GiB
  of MLA latent cache left at 0.8 of the GPU (51 full 9k-token sequences per engine). On 80 GB H100s an
  engine takes whole nodes: NeMo-RL's published 256-GPU layout (TP 1 x PP 16 x EP 16, bf16 vLLM at TP 32
  over four nodes) plans and checks (``python -m megatron_maspo.launch.plan.published_layouts``). FP8
  sampling is not the trained policy, so the recipe corrects for it with truncated importance sampling
  (``loss.tis_cap=2``).
- **The trainer.** 61 layers admit no even pipeline split, so PP is 1; TP 8 splits attention, the three
  dense layers and the shared experts inside a node (sequence parallelism, on by default for MoE) and EP 256
  puts one of each layer's 256 experts on each GPU. The colocated engine wakes on top of the trainer's
  resident state, so that state (8.9 + 17.8 + 14.7 GiB of weights, fp32 gradients and sharded optimizer) is
  what makes 64 nodes the smallest fitting count (at 32 nodes expert DP is 1 and the optimizer doubles); it
  goes to the host during generation (``train.offload_*``: 41 GiB per GPU of pinned memory).
- The router's fp32 correction bias stays frozen during RL (``model.moe_expert_bias=false``); the MTP layer
  is passed through conversion, not trained. Published weights are block-FP8: dequantise them to bf16 before
  ``maspo convert`` (docs/deepseek-v3.md).

    maspo plan deepseek_v3_maspo --nodes 64 --splits
    maspo check deepseek_v3_maspo          # full size on the meta device
    maspo launch deepseek_v3_maspo --executor slurm --nodes 64 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import FP8_ENGINES_OFFLOADED, paper_config, with_settings

NAME = "deepseek-v3-maspo"


def config() -> MaspoConfig:
    cfg = paper_config(name=NAME, source="/models/DeepSeek-V3-bf16", arch="deepseek-v3", alpha=0.3, nodes=64,
                       tp=8, pp=1, ep=256, recompute="full", vllm_tp=8, vllm_gpu_memory_utilization=0.8)
    return with_settings(cfg, (("parallel.gpu", "h200"), *FP8_ENGINES_OFFLOADED))
