"""MASPO paper §5.4: GRPO (clip 1 ± 0.2, verl dual-clip 3) on DeepSeek-R1-Distill-Qwen-14B.

Every value's source is in ``recipes/base.py`` (``SETTINGS``).

    maspo plan r1_distill_qwen_14b_grpo --nodes 4 --gpus-per-node 8
    maspo launch r1_distill_qwen_14b_grpo --executor slurm --nodes 4 --dry-run
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import table1


def config() -> MaspoConfig:
    return table1("grpo", "14b")
