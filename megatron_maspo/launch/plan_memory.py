"""Colocated memory with trainer offload: what leaves the GPU during generation, and the host memory it needs.

``train.offload_params / offload_grads / offload_optimizer`` (train/actor/offload.py) move the trainer's state
to pinned host memory while the engine generates and back before the update. The planner's memory
categories are the offloader's categories, per GPU:

    params      weights (+ the frozen reference model's weights with train.reference_model)
    grads       the fp32 gradient buffer
    optimizer   fp32 master copies (bf16 only) + Adam m, v, sharded by the distributed optimizer

so during generation the GPU holds only what is not offloaded, and the host holds the rest:

    rollout peak = weights + reference + grads + optimizer - offloaded + engine + reserve
    host         = offloaded per GPU (x GPUs per node for one node's pinned memory)

The update phase reloads everything, so the train peak does not change. tests/distributed/
test_plan_memory.py compares these per-category figures with the bytes ``StateOffloader`` measures on
CPU runs of a tiny model (1 rank fp32 with a reference model; 2 ranks bf16 + distributed optimizer).
"""

from __future__ import annotations

from megatron_maspo.train.actor.offload import CATEGORIES, offload_categories


def category_bytes(*, weights: float, reference: float, grads: float, optimizer: float) -> dict[str, float]:
    """The planner's per-GPU bytes under the offloader's category names (``train/actor/offload.py``)."""
    return {"params": weights + reference, "grads": grads, "optimizer": optimizer}


def offloaded_bytes(by_category: dict[str, float], *, params: bool, grads: bool,
                    optimizer: bool) -> dict[str, float]:
    """Bytes per GPU moved to the host during generation, per category (0 for categories kept)."""
    on = offload_categories(params, grads, optimizer)
    return {c: (by_category[c] if c in on else 0.0) for c in CATEGORIES}
