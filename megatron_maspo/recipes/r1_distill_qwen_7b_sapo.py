"""MASPO paper Table 1: SAPO (soft gate, seq-mean-token-mean) on DeepSeek-R1-Distill-Qwen-7B.

Every value's source is in ``recipes/base.py`` (``SETTINGS``).

    maspo plan r1_distill_qwen_7b_sapo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_7b_sapo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import table1


def config() -> MaspoConfig:
    return table1("sapo", "7b")
