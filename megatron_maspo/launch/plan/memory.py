"""Colocated memory with trainer offload: what leaves the GPU during generation, and the host memory it needs.

``train.offload_params / offload_grads / offload_optimizer`` (train/actor/offload.py) move the trainer's state
to pinned host memory while the engine generates and back before the update. The planner's memory
categories are the offloader's categories (parallel/offload_categories.py), per GPU:

    params      weights (+ the frozen reference model's weights with train.reference_model)
    grads       the fp32 gradient buffer
    optimizer   fp32 master copies (bf16 only) + Adam m, v, sharded by the distributed optimizer

so once offloaded the GPU holds only what is not, and the host holds the rest:

    rollout peak = the highest running total over ROLLOUT_PHASE_ORDER (below): the offloaded gradients and
                   optimizer state leave, the engine's weights wake and the sync runs on top of what is left,
                   the weights leave, then the KV cache wakes
    host         = offloaded per GPU (x GPUs per node for one node's pinned memory)

The update phase reloads everything, so the train peak does not change. tests/distributed/
test_plan_memory.py compares these per-category figures with the bytes ``StateOffloader`` measures on
CPU runs of a tiny model (1 rank fp32 with a reference model; 2 ranks bf16 + distributed optimizer).

Where each term comes from (audited against megatron-core 0.16.1 and vLLM in 2026-12; the figures and the
layouts checked are in docs/performance-model.md §7; tests/unit/launch/test_plan_memory_terms.py pins them):

    grads       4 bytes per local parameter: the trainer builds Megatron's DDP with grad_reduce_in_fp32=True
                (train/actor/optimizer.py::wrap_ddp), so every ``main_grad`` is a view into an fp32
                ``grad_data`` buffer of the whole local model (distributed/param_and_grad_buffer.py); the
                distributed optimizer reduce-scatters into that full buffer, it does not shrink it
    optimizer   12 bytes per parameter (fp32 main copy + Adam m and v) for 16-bit weights, 8 for fp32
                (the main params are the model's), divided by the group the distributed optimizer shards
                over: each ``_ParamAndGradBuffer``'s ``data_parallel_group`` (optimizer/distrib_optimizer.py,
                ``_build_model_gbuf_range``), which is the dp x cp group for dense parameters and the
                expert-data-parallel group for experts (distributed/distributed_data_parallel.py passes
                ``intra_expt_dp_group`` to the expert buffers), of size world / (expert TP x EP x PP) =
                dp x tp x cp / ep at expert TP 1 (parallel_state.py, ``expert_data_parallel_size``)
    params      the 16-bit weights once: with the distributed optimizer (and overlap_param_gather) the
                parameters *are* views into the buffer's ``param_data``, which the all-gather fills in
                place; no second gather buffer exists outside MXFP8 (param_and_grad_buffer.py)
    engine      vLLM's gpu_memory_utilization is a fraction of the whole device for this engine alone
                (weights + activations + KV; its start-up check refuses when free memory is below
                utilisation x total), and sleep mode frees the weights and KV tags while the trainer
                trains, so the share counts in the rollout phases only, never in the train peak

The rollout phases below are the trainer's (``train/actor/offload.py::STEP_PHASES``). Until 2026-12 the
trainer woke the engine's weights and synced with its whole state resident, offloading only after the
sync; the audit found that order, not a memory term, behind refusals of layouts published runs used
(docs/performance-model.md §7), and the trainer now offloads the gradients and optimizer state first.
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
    ("state_offload", (("offloaded_state", -1),)),
    ("weights_wake", (("engine_weights", +1),)),
    ("sync", (("sync_bucket", +1), ("sync_bucket", -1))),
    ("params_offload", (("offloaded_params", -1),)),
    ("kv_wake", (("engine_kv", +1),)),
)
"""(phase, ((memory term, sign), ...)) in the trainer's order (``train/actor/offload.py::STEP_PHASES``):
the offloaded gradients and optimizer state go to the host before the engine's weights wake, the sync
streams from the resident weights, then the offloaded weights leave and the KV cache wakes (NeMo-RL's
Megatron worker keeps the same order around its refit). A term added and removed inside one phase (the
sync bucket) is transient: it counts at its height, then leaves."""

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
