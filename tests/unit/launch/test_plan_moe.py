"""``maspo plan`` validates MoE layouts with the dispatcher/router settings the trainer reads."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_maspo.launch.plan import Layout, arch_of, estimate, layout_of, local_params
from megatron_maspo.model.moe import moe_summary
from megatron_maspo.recipes.registry import load_recipe


@pytest.fixture()
def cfg():
    return load_recipe("qwen3_30b_a3b_maspo")


def _lay(**kw) -> Layout:
    return Layout(**{**dict(tp=1, pp=1, ep=8, recompute="full", distributed_optimizer=True, vllm_tp=1), **kw})


def test_qwen3_30b_a3b_recipe_fits_with_the_trainer_moe_settings(cfg):
    spec = arch_of(cfg)
    assert estimate(cfg, spec, layout_of(cfg), nodes=4, gpus_per_node=8).fits
    assert moe_summary(cfg.model) == "moe: dispatcher=alltoall load_balancing=none router=fp32 routing_replay=off"


def test_fine_grained_layout(cfg):
    cfg.model.arch = "fine-grained-moe-16b"
    spec = arch_of(cfg)
    assert spec.num_moe_experts == 64 and spec.moe_router_topk == 6 and spec.moe_shared_expert_intermediate_size
    assert estimate(cfg, spec, _lay(), nodes=2, gpus_per_node=8).fits
    # 64 experts do not split 48 ways
    assert any("not divisible by expert_model_parallel_size=48" in r
               for r in estimate(cfg, spec, _lay(ep=48), nodes=6, gpus_per_node=8).reasons)


def test_moe_tp_needs_sequence_parallelism(cfg):
    """MoE at TP 2: accepted with ``parallel.sequence_parallel`` unset (on for MoE) on either spec, refused
    when it is forced off."""
    spec = arch_of(cfg)
    local = estimate(cfg, spec, _lay(tp=2), nodes=2, gpus_per_node=8)
    assert not any("sequence parallelism" in r for r in local.reasons)
    cfg.model.attention_backend = "te"
    te = estimate(cfg, spec, _lay(tp=2), nodes=2, gpus_per_node=8)
    assert not any("sequence parallelism" in r for r in te.reasons)
    cfg.parallel.sequence_parallel = False
    off = estimate(cfg, spec, _lay(tp=2), nodes=2, gpus_per_node=8)
    assert any("needs sequence parallelism" in r for r in off.reasons)
    # expert weights are not split by TP (expert_tensor_parallel_size=1): only the dense part halves
    d1, e1 = local_params(spec, _lay(tp=1))
    d2, e2 = local_params(spec, _lay(tp=2))
    assert e2 == e1 and d2 < d1


def test_dispatcher_and_replay_settings_are_checked(cfg):
    spec = arch_of(cfg)
    for fields, needle in ((dict(moe_dispatcher="flex"), None),
                           (dict(moe_dispatcher="allgather"), "moe_dispatcher='allgather' at ep=16")):
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))
        reasons = estimate(c, spec, _lay(ep=16), nodes=2, gpus_per_node=8).reasons
        assert (needle is None and not any("dispatcher" in r for r in reasons)) or \
            any(needle in r for r in reasons), reasons
    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_dispatcher="flex"))
    assert any("'flex' needs ep > 1" in r for r in estimate(c, spec, _lay(ep=1), nodes=1, gpus_per_node=8).reasons)
