"""Colocated memory with trainer offload: what leaves the GPU during generation, and the host memory it needs.

``train.offload_params / offload_grads / offload_optimizer`` (train/actor/offload.py) move the trainer's state
to pinned host memory while the engine generates and back before the update. The planner's memory
categories are the offloader's categories (parallel/offload_categories.py), per GPU:

    params      weights (+ the frozen reference model's weights with train.reference_model)
    grads       the fp32 gradient buffer
    optimizer   fp32 master copies (bf16 only) + Adam m, v, sharded by the distributed optimizer

so once offloaded the GPU holds only what is not, and the host holds the rest:

    rollout peak = the highest running total over ROLLOUT_PHASE_ORDER (below): the engine's weights wake
                   and the sync runs on top of the whole resident state, the KV cache wakes after offload
    host         = offloaded per GPU (x GPUs per node for one node's pinned memory)

The update phase reloads everything, so the train peak does not change. tests/distributed/
test_plan_memory.py compares these per-category figures with the bytes ``StateOffloader`` measures on
CPU runs of a tiny model (1 rank fp32 with a reference model; 2 ranks bf16 + distributed optimizer).
"""

from __future__ import annotations

from megatron_maspo.parallel.offload_categories import CATEGORIES, offload_categories


def category_bytes(*, weights: float, reference: float, grads: float, optimizer: float) -> dict[str, float]:
    """The planner's per-GPU bytes under the offloader's category names (``parallel/offload_categories.py``)."""
    return {"params": weights + reference, "grads": grads, "optimizer": optimizer}


def offloaded_bytes(by_category: dict[str, float], *, params: bool, grads: bool,
                    optimizer: bool) -> dict[str, float]:
    """Bytes per GPU moved to the host during generation, per category (0 for categories kept)."""
    on = offload_categories(params, grads, optimizer)
    return {c: (by_category[c] if c in on else 0.0) for c in CATEGORIES}


# --- the rollout's phase order --------------------------------------------------------------------------
# What each phase of the switch from training to generation adds to (+) or takes from (-) the GPU, in the
# order the trainer runs them: the engine's weights wake first (the sync streams into them from the
# trainer's resident weights, one bucket at a time), then the trainer's state goes to the host, and only
# then does the engine's KV cache wake. Kept as data so the order can be compared with what the trainer
# reports it runs; the rollout peak is the highest running total over these phases.

ROLLOUT_PHASE_ORDER: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("weights_wake", (("engine_weights", +1),)),
    ("sync", (("sync_bucket", +1), ("sync_bucket", -1))),
    ("trainer_offload", (("offloaded", -1),)),
    ("kv_wake", (("engine_kv", +1),)),
)
"""(phase, ((memory term, sign), ...)) in the trainer's order; a term added and removed inside one phase
(the sync bucket) is transient: it counts at its height, then leaves."""

ROLLOUT_START_TERMS = ("trainer_state", "reserve")
"""Resident when the update ends and generation begins: the trainer's weights, reference, grads and
optimizer state, and the CUDA context / allocator reserve."""


def rollout_trace(terms: dict[str, float], order=ROLLOUT_PHASE_ORDER) -> list[tuple[str, float]]:
    """(phase, highest GPU memory reached inside it) for the phases of ``order``, from the resident start.

    ``terms`` maps each term name of ``order`` and ``ROLLOUT_START_TERMS`` to its size (any unit).
    """
    level = sum(terms[t] for t in ROLLOUT_START_TERMS)
    out = []
    for phase, steps in order:
        high = level
        for term, sign in steps:
            level += sign * terms[term]
            high = max(high, level)
        out.append((phase, high))
    return out
