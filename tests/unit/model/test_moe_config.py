"""MoE settings: field validation, Megatron keys, refusals that name the constraint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_maspo.config import MaspoConfig
from megatron_maspo.errors import ConfigError
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.model.moe import check_model_layout, moe_transformer_kwargs
from megatron_maspo.model.provider import ModelBuildOptions, build_transformer_config
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train.config import TrainConfig


def _moe() -> ArchSpec:
    return ArchSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                    num_attention_heads=4, num_query_groups=2, kv_channels=8, vocab_size=101,
                    max_position_embeddings=256, qk_layernorm=True, num_moe_experts=4,
                    moe_ffn_hidden_size=16, moe_router_topk=2, moe_norm_topk_prob=True)


@pytest.mark.parametrize("fields, needle", [
    (dict(moe_dispatcher="deepep"), "model.moe_dispatcher"),
    (dict(moe_load_balancing="sinkhorn"), "model.moe_load_balancing"),
    (dict(routing_replay="yes"), "model.routing_replay"),
    (dict(moe_aux_loss_coeff=0.01), "needs model.moe_load_balancing"),
    (dict(moe_z_loss_coeff=-1.0), ">= 0"),
    (dict(moe_expert_bias_update_rate=-1.0), ">= 0"),
])
def test_bad_fields_are_refused(fields, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**fields)


def test_cross_section_refusals():
    with pytest.raises(ValueError, match="rollout.engine='vllm'"):
        MaspoConfig(model=ModelConfig(routing_replay="all"), rollout=RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="check_first_ratio"):
        MaspoConfig(model=ModelConfig(routing_replay="old_logprobs"), train=TrainConfig(check_first_ratio=True))
    with pytest.raises(ValueError, match="needs parallel.ep > 1"):
        MaspoConfig(model=ModelConfig(moe_dispatcher="flex"))
    MaspoConfig(model=ModelConfig(routing_replay="all"))  # builtin engine: accepted


def test_megatron_keys():
    opts = ModelBuildOptions(ep=2, moe_load_balancing="seq_aux_loss", moe_aux_loss_coeff=1e-3,
                             moe_z_loss_coeff=1e-3, routing_replay=True, bf16=True)
    kw = moe_transformer_kwargs(_moe(), opts)
    assert kw["moe_token_dispatcher_type"] == "alltoall" and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_router_load_balancing_type"] == "seq_aux_loss" and kw["moe_aux_loss_coeff"] == 1e-3
    assert kw["moe_z_loss_coeff"] == 1e-3 and kw["moe_enable_routing_replay"] is True
    assert kw["expert_tensor_parallel_size"] == 1
    assert "moe_router_dtype" not in moe_transformer_kwargs(_moe(), ModelBuildOptions(ep=2))  # fp32 model
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA and DeepEP"):
            moe_transformer_kwargs(_moe(), ModelBuildOptions(ep=2, moe_dispatcher="flex"))


def test_moe_tp2_ep2_needs_sequence_parallelism():
    """MoE at TP 2 x EP 2: sequence parallelism is on by default (``parallel.sequence_parallel=None``), and
    the local spec builds it (SP torch norms); forcing it off is refused with a one-line error."""
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        build_transformer_config(_moe(), ModelBuildOptions(tp=2, ep=2))
    cfg = MaspoConfig(parallel=ParallelConfig(tp=2, ep=2, world_size=4))
    check_model_layout(cfg.model, cfg.parallel, _moe())  # default: SP on for MoE at TP > 1
    cfg.parallel.sequence_parallel = False
    with pytest.raises(ConfigError, match=r"parallel.tp=2 parallel.pp=1 parallel.ep=2: MoE with "
                                          r"tensor_model_parallel_size > 1 needs sequence parallelism"):
        check_model_layout(cfg.model, cfg.parallel, _moe())
    from megatron_maspo.train.actor.inference import actor_build_options

    assert actor_build_options(cfg.model, ParallelConfig(tp=2, ep=2, world_size=4), _moe()).sequence_parallel
    assert not actor_build_options(cfg.model, ParallelConfig(tp=2, world_size=2), tiny_qwen2_spec()).sequence_parallel
    with pytest.raises(ConfigError, match="needs an MoE model"):
        check_model_layout(ModelConfig(routing_replay="all"), MaspoConfig().parallel, tiny_qwen2_spec())


def test_expert_bias_update_needs_a_model_with_a_correction_bias():
    """``model.moe_expert_bias`` (update the bias) is refused at start-up for a softmax router; for a
    sigmoid router with a bias it sets Megatron's update rate, and the default (frozen) sets rate 0."""
    with pytest.raises(ConfigError, match="has none"):
        check_model_layout(ModelConfig(moe_expert_bias=True), MaspoConfig().parallel, _moe())
    sig = dataclasses.replace(_moe(), moe_router_score_function="sigmoid", moe_router_expert_bias=True)
    check_model_layout(ModelConfig(moe_expert_bias=True), MaspoConfig().parallel, sig)
    frozen = moe_transformer_kwargs(sig, ModelBuildOptions())
    assert frozen["moe_router_enable_expert_bias"] and frozen["moe_router_bias_update_rate"] == 0.0
    live = moe_transformer_kwargs(sig, ModelBuildOptions(moe_expert_bias_update=True, moe_expert_bias_update_rate=2e-3))
    assert live["moe_router_bias_update_rate"] == 2e-3
