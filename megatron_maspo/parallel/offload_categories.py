"""The trainer's GPU state in offload categories: what ``train.offload_*`` moves to host memory.

Torch-free, so the trainer's offloader (``train/actor/offload.py``) and the planner's memory model
(``launch/plan/memory.py``) name the same categories without the planner importing the trainer:

    params      weights (+ the frozen reference model's with train.reference_model)
    grads       the fp32 gradient buffer
    optimizer   fp32 master copies (bf16 only) + Adam m, v, sharded by the distributed optimizer

The order is the claim order: a storage claimed by an earlier category is never moved by a later one.
"""

from __future__ import annotations

CATEGORIES = ("params", "grads", "optimizer")


def offload_categories(params: bool, grads: bool, optimizer: bool) -> tuple[str, ...]:
    """The enabled categories, in claim order, from three switches (``train.offload_*``)."""
    return tuple(c for c, on in zip(CATEGORIES, (params, grads, optimizer)) if on)
