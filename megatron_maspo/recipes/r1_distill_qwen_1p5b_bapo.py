"""MASPO paper Table 1: BAPO (adaptive bounds, ρ₀ 0.5) on DeepSeek-R1-Distill-Qwen-1.5B.

Every value's source is in ``recipes/base.py`` (``SETTINGS``).

    maspo plan r1_distill_qwen_1p5b_bapo --nodes 1 --gpus-per-node 8
    maspo launch r1_distill_qwen_1p5b_bapo --executor slurm --nodes 1 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import table1


def config() -> MaspoConfig:
    return table1("bapo", "1p5b")
