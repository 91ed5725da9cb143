"""DeepSeek-V3 (671 B, 37 B active) MASPO layout for ``maspo check``: 32 nodes x 8 GPUs, EP 64 x PP 1.

Kept out of the packaged recipes because ``maspo plan`` does not find a layout that fits 80 GiB GPUs for
it yet (docs/deepseek-v3.md: the planner's expert optimizer memory under EP is being reworked). 61 layers
admit no even pipeline split (61 is prime) and the local spec runs MoE at TP 1, so attention and the three
dense layers are replicated and the 256 experts are split 64 ways (4 per GPU).

    maspo check examples/deepseek_v3_maspo.py       # full size on the meta device: passes in ~3.5 min
    maspo plan examples/deepseek_v3_maspo.py --nodes 32
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "deepseek-v3-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/DeepSeek-V3-bf16", arch="deepseek-v3", alpha=0.3,
                        nodes=32, tp=1, pp=1, ep=64, recompute="full", vllm_tp=8)
