"""The planner's per-GPU memory terms against their sources (launch/plan/memory.py lists them; the audit and
the published layouts it was checked with are in docs/performance-model.md §7).

Every term below was audited against megatron-core 0.16.1 and vLLM and found right for this trainer, so these
tests pin the formulas rather than a correction; what the audit changed is the trainer's phase order
(``test_the_grads_and_optimizer_leave_before_the_engines_weights_wake``).
"""

from __future__ import annotations

import pytest

from megatron_maspo.launch.plan import GIB, arch_of, estimate, layout_of, local_params
from megatron_maspo.launch.plan.types import gpu_assumptions
from megatron_maspo.overrides import set_path
from megatron_maspo.recipes.registry import load_recipe

OFFLOAD = {"train.offload_params": True, "train.offload_grads": True, "train.offload_optimizer": True}
QWEN3_30B_4K = {"parallel.pp": 1, "rollout.max_new_tokens": 3072, "train.max_tokens_per_micro_batch": 4096}
"""NeMo-RL's Qwen3-30B-A3B layout (TP 1, EP 8, PP 1, generation TP 2, 4k) on the recipe's TP 1 / EP 8."""


def _plan(recipe: str, nodes: int, *sets: dict):
    """``recipe`` with every ``{dotted key: value}`` of ``sets`` applied, planned on ``nodes`` x 8 GPUs."""
    cfg = load_recipe(recipe)
    for key, value in {k: v for d in sets for k, v in d.items()}.items():
        cfg = set_path(cfg, key, value)
    return cfg, estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=nodes, gpus_per_node=8,
                         hw=gpu_assumptions(cfg.parallel.gpu))


@pytest.mark.parametrize("recipe,nodes,sets,edp", [
    ("qwen3_30b_a3b_maspo", 1, QWEN3_30B_4K, 1),              # 8 GPUs, EP 8: each expert on one GPU
    ("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, 4),
    ("qwen3_30b_a3b_maspo", 4, {**QWEN3_30B_4K, "parallel.tp": 2}, 4),  # dp halves, tp doubles: same group
    ("qwen3_235b_a22b_maspo", 16, {"parallel.tp": 2, "parallel.pp": 2, "parallel.ep": 16, "parallel.cp": 2,
                                   "model.attention_backend": "te"}, 4),
])
def test_expert_optimizer_shards_over_the_expert_data_parallel_group(recipe, nodes, sets, edp):
    """megatron-core: the distributed optimizer shards each buffer over its ``data_parallel_group``; the
    expert buffers get ``intra_expt_dp_group``, of size world / (expert TP x EP x PP) (parallel_state.py),
    = dp x tp x cp / ep at expert TP 1. Dense parameters shard over dp x cp."""
    cfg, plan = _plan(recipe, nodes, sets)
    lay, world = layout_of(cfg), nodes * 8
    assert world // (1 * lay.ep * lay.pp) == edp == plan.dp * lay.tp * lay.cp // lay.ep
    p_dense, p_expert = local_params(arch_of(cfg), lay, cfg.model.make_vocab_size_divisible_by)
    want = (p_dense / (plan.dp * lay.cp) + p_expert / edp) * 12 / GIB
    assert plan.memory.optimizer == pytest.approx(want)


def test_grad_buffer_is_fp32_and_whole_under_the_distributed_optimizer():
    """wrap_ddp builds Megatron's DDP with grad_reduce_in_fp32=True: an fp32 ``grad_data`` of every local
    parameter, which the distributed optimizer reduce-scatters into without shrinking it."""
    cfg, sharded = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K)
    _, whole = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, {"parallel.distributed_optimizer": False})
    p = sum(local_params(arch_of(cfg), layout_of(cfg), cfg.model.make_vocab_size_divisible_by))
    assert sharded.memory.grads == whole.memory.grads == pytest.approx(4 * p / GIB)
    assert sharded.memory.weights == pytest.approx(2 * p / GIB)
    assert sharded.memory.optimizer < whole.memory.optimizer == pytest.approx(12 * p / GIB)


def test_fp32_training_keeps_no_master_copy():
    """fp32 weights are their own main params: Adam's m and v only (8 bytes), weights 4 bytes."""
    cfg, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, {"model.bf16": False,
                                                                           "parallel.distributed_optimizer": False})
    p = sum(local_params(arch_of(cfg), layout_of(cfg), cfg.model.make_vocab_size_divisible_by))
    assert (plan.memory.weights, plan.memory.optimizer) == pytest.approx((4 * p / GIB, 8 * p / GIB))


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_param_gather_adds_no_buffer(overlap):
    """With the distributed optimizer the parameters are views into ``param_data`` and the all-gather fills
    it in place (param_and_grad_buffer.py): overlapping it adds no memory term."""
    _, base = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K)
    _, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, {"parallel.overlap_grad_reduce": True,
                                                                        "parallel.overlap_param_gather": overlap})
    assert plan.memory == base.memory


def test_engine_share_is_a_device_fraction_outside_the_train_peak():
    """vLLM's gpu_memory_utilization is this engine's share of the whole device (weights + KV + its
    activations); sleep mode frees weights and KV during the update, so the share never meets the train
    peak, and it counts whole at the KV wake, on top of what the trainer keeps."""
    _, lo = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, {"rollout.vllm_gpu_memory_utilization": 0.4})
    _, hi = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, {"rollout.vllm_gpu_memory_utilization": 0.6})
    assert (lo.memory.engine, hi.memory.engine) == pytest.approx((0.4 * 80, 0.6 * 80))
    assert lo.memory.train_peak == hi.memory.train_peak
    m = hi.memory
    kept = m.weights + m.reference + m.grads + m.optimizer - m.host
    assert dict(m.rollout_trace)["kv_wake"] == pytest.approx(kept + m.reserve + m.engine)


@pytest.mark.parametrize("flags,kept", [(OFFLOAD, ()), ({"train.offload_grads": True}, ("weights", "optimizer"))])
def test_offloaded_state_and_the_kv_cache_are_never_summed(flags, kept):
    """The trainer offloads before the KV cache wakes (STEP_PHASES): at the KV wake only what it keeps is
    beside the engine's share."""
    _, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, flags)
    m = plan.memory
    assert dict(m.rollout_trace)["kv_wake"] == pytest.approx(sum(getattr(m, k) for k in kept) + m.reserve + m.engine)


def test_full_recompute_keeps_layer_inputs_and_one_layer():
    """Megatron's full recompute (uniform, one layer per checkpoint): each in-flight micro-batch keeps every
    layer's input (h elements per token), and the layer being recomputed holds its full set once."""
    from megatron_maspo.launch.plan import activation_bytes

    cfg, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K)
    spec, n = arch_of(cfg), cfg.train.max_tokens_per_micro_batch
    assert layout_of(cfg).recompute == "full" and layout_of(cfg).pp == 1  # one micro-batch in flight
    want = spec.num_layers * n * 2 * spec.hidden_size + n * activation_bytes(spec, 1, None, 2) + n * spec.hidden_size * 2
    assert plan.memory.activations == pytest.approx(want / GIB)


def test_nemo_rl_qwen3_30b_layout_fits_with_offload():
    """NeMo-RL's published Qwen3-30B-A3B run (32 H100, TP 1 x EP 8, generation TP 2, 4k) with the trainer's
    state offloaded during generation, as NeMo-RL runs it colocated."""
    _, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, OFFLOAD)
    assert plan.fits, plan.reasons


def test_the_grads_and_optimizer_leave_before_the_engines_weights_wake():
    """Half those GPUs: the trainer used to wake the engine's weights and sync with its grads and optimizer
    still on the GPU (82.1 GiB at the sync: refused); the audit found that order, not a term, behind the
    refusal, and the trainer now offloads them first (train/actor/offload.py::STEP_PHASES), so the sync
    peaks at the weights, the reserve and the engine's weights, and the layout fits."""
    _, plan = _plan("qwen3_30b_a3b_maspo", 2, QWEN3_30B_4K, OFFLOAD)
    m = plan.memory
    assert plan.fits, plan.reasons
    trace = dict(m.rollout_trace)
    assert trace["state_offload"] == pytest.approx(m.weights + m.reference + m.grads + m.optimizer + m.reserve)
    assert trace["sync"] == pytest.approx(m.weights + m.reference + m.reserve + m.engine_weights + m.sync_bucket)
    assert trace["kv_wake"] == pytest.approx(m.reserve + m.engine)
    held = m.weights + m.reference + m.grads + m.optimizer + m.reserve + m.engine_weights + m.sync_bucket
    assert held > 80 > m.peak  # what the old order needed at the sync, against what this one does


def test_a_vllm_sync_holds_three_buckets_on_the_gpu():
    """The trainer's two pool buffers (double buffering) and the worker's private copy of the bucket it
    loads (rollout/transport.py::take_bucket) are on one GPU at once; the planner counted one bucket."""
    cfg, plan = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, OFFLOAD)
    assert cfg.rollout.engine == "vllm" and cfg.rollout.weight_transport == "ipc"
    assert plan.memory.sync_bucket == pytest.approx(3 * cfg.rollout.bucket_mb / 1024)
    _, builtin = _plan("qwen3_30b_a3b_maspo", 4, QWEN3_30B_4K, OFFLOAD, {"rollout.engine": "builtin"})
    assert builtin.memory.sync_bucket == pytest.approx(cfg.rollout.bucket_mb / 1024)
