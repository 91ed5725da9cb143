"""MASPO paper Table 1: Entropy Advantage (GRPO, Â + min(0.4·H, |Â|/2)) on DeepSeek-R1-Distill-Qwen-1.5B.

Every value's source is in ``recipes/base.py`` (``SETTINGS``).

    maspo plan r1_distill_qwen_1p5b_entropy_adv --nodes 1 --gpus-per-node 8
    maspo launch r1_distill_qwen_1p5b_entropy_adv --executor slurm --nodes 1 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import table1


def config() -> MaspoConfig:
    return table1("entropy_adv", "1p5b")
