"""MASPO paper Table 1: BAPO (adaptive bounds, ρ₀ 0.5) on DeepSeek-R1-Distill-Qwen-7B.

Every value's source is in ``recipes/base.py`` (``SETTINGS``).

    maspo plan r1_distill_qwen_7b_bapo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_7b_bapo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import table1


def config() -> MaspoConfig:
    return table1("bapo", "7b")
