"""A small DeepSeek-V3-architecture model (15.7 B total, 2.4 B active) MASPO layout: 2 nodes x 8 H100, EP 8.

The ``deepseek-v3-small`` planning layout (``model/families/deepseek_v3.py``): DeepSeek-V2-Lite's shapes
(27 layers, hidden 2048, 16 MLA heads without a query latent, KV latent 512, 64 routed experts of 1408 plus
2 shared, top-6, the first layer dense) with DeepSeek-V3's router (sigmoid, fp32 correction bias) and YaRN.
No published checkpoint has these shapes: it is the layout to rehearse a DeepSeek-V3 run on two nodes (the
same MLA, router, conversion and sync paths as the 671B recipe) before booking 64. TP 1 x EP 8 x PP 1:
attention and the dense layer are replicated, eight experts per GPU, expert DP 2 (EP 8 also lets an 8-GPU
training pool run it, the one-step-off split); vLLM at TP 2 in bf16. megatron-core 0.19's local spec refuses
MLA without a query latent (docs/stack.md 3.5): this layout builds on 0.16.1's local spec.

    maspo plan deepseek_v3_small_maspo --nodes 2 --splits
    maspo check deepseek_v3_small_maspo
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "deepseek-v3-small-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/deepseek-v3-small", arch="deepseek-v3-small", alpha=0.3,
                        nodes=2, tp=1, pp=1, ep=8, recompute="full", vllm_tp=2)
