"""The DeepSeek-V3-style MoE router and MLP features, in one place for every family that has them.

DeepSeek-V3 (arXiv 2412.19437 §2.1.2) and GLM-4.5 route with the same block, which megatron-core 0.16.1
builds from ``TransformerConfig`` keys (``transformer/moe/moe_utils.py``, ``topk_routing_with_score_function``):

* sigmoid scores ``s = sigmoid(h W_r^T)`` (``[T, E]``, fp32);
* an fp32 score-correction bias ``b`` (``[E]``, HF ``e_score_correction_bias``, Megatron's persistent
  ``router.expert_bias`` buffer) used for SELECTION only: ``experts = topk(s + b)``, gates ``g = s[experts]``;
* group-limited top-k: the ``E`` experts form ``n_group`` groups, a group scores the sum of its top
  ``topk / topk_group`` biased scores and only the best ``topk_group`` groups are eligible;
* normalised top-k ``g / sum(g)`` (Megatron always normalises sigmoid gates at top-k > 1);
* ``routed_scaling_factor`` multiplying the gates;
* shared experts (Megatron's ``SharedExpertMLP``) added to the routed output for every token;
* dense first layers (HF ``first_k_dense_replace``) through ``moe_layer_freq`` as a list.

The correction bias in RL: Megatron updates it after every optimizer step with the aux-loss-free rule
``b_i += rate * sign(mean_load - load_i)`` (``moe_utils.get_updated_expert_bias``, called from
``finalize_model_grads``) unless the rate is 0. The run config decides (``model.moe_expert_bias``,
``train_kwargs``): frozen by default, as NeMo-RL's GRPO recipes and verl's Megatron examples freeze it
(``moe_router_bias_update_rate=0``): the policy's routing then only changes through the router weights
the loss trains, and the rollout engine (which never updates it) routes with the same bias.

Torch-free: read by ``ArchSpec`` validation, the provider and the planner.
"""

from __future__ import annotations

from typing import Any

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def validate_router(spec: Any) -> None:
    """Check an MoE ``ArchSpec``'s router fields against what megatron-core 0.16.1 computes.

    Raises:
        ValueError: naming the ``ArchSpec`` field.
    """
    e = spec.num_moe_experts
    if spec.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"ArchSpec.moe_router_score_function={spec.moe_router_score_function!r}; "
                         f"accepted: {SCORE_FUNCTIONS}")
    if not 1 <= spec.moe_router_topk <= e:
        raise ValueError(f"ArchSpec.moe_router_topk={spec.moe_router_topk} must be in [1, {e}]")
    if spec.moe_router_expert_bias and spec.moe_router_score_function != "sigmoid":
        raise ValueError("ArchSpec.moe_router_expert_bias needs moe_router_score_function='sigmoid' "
                         "(megatron-core adds the correction bias to sigmoid scores only)")
    if spec.moe_router_score_function == "sigmoid" and spec.moe_router_topk > 1 and not spec.moe_norm_topk_prob:
        raise ValueError("ArchSpec.moe_norm_topk_prob=False with sigmoid scores: megatron-core 0.16.1 always "
                         "normalises the top-k sigmoid gates (norm_topk_prob=True)")
    groups, group_topk = spec.moe_router_num_groups, spec.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("ArchSpec.moe_router_num_groups and moe_router_group_topk are set together or not at all")
    if groups is not None:
        if groups < 1 or e % groups:
            raise ValueError(f"ArchSpec.moe_router_num_groups={groups} must divide num_moe_experts={e}")
        if not 1 <= group_topk <= groups:
            raise ValueError(f"ArchSpec.moe_router_group_topk={group_topk} must be in [1, {groups}]")
        if spec.moe_router_topk % group_topk:
            raise ValueError(f"ArchSpec.moe_router_topk={spec.moe_router_topk} is not a multiple of "
                             f"moe_router_group_topk={group_topk}")
    if spec.moe_router_topk_scaling_factor is not None and spec.moe_router_topk_scaling_factor <= 0:
        raise ValueError(f"ArchSpec.moe_router_topk_scaling_factor={spec.moe_router_topk_scaling_factor} must be > 0")
    if not 0 <= spec.moe_first_k_dense < spec.num_layers:
        raise ValueError(f"ArchSpec.moe_first_k_dense={spec.moe_first_k_dense} must be in [0, num_layers="
                         f"{spec.num_layers}) (at least one MoE layer)")


def moe_layer_freq(spec: Any) -> int | list[int]:
    """Megatron ``moe_layer_freq``: 1 (every layer MoE) or the per-layer list ``[0]*k + [1]*(L-k)``."""
    k = spec.moe_first_k_dense
    return [0] * k + [1] * (spec.num_layers - k) if k else 1


def router_transformer_kwargs(spec: Any, *, update_expert_bias: bool, expert_bias_update_rate: float) -> dict:
    """Megatron ``TransformerConfig`` keys of the router / shared-expert / layer-pattern features.

    Args:
        spec: an MoE ``ArchSpec``.
        update_expert_bias: apply the aux-loss-free update to the correction bias after each step
            (``model.moe_expert_bias``); False = frozen (update rate 0: ``b + sign(.) * 0`` is ``b`` exactly).
        expert_bias_update_rate: the update step when ``update_expert_bias``.
    """
    sigmoid = spec.moe_router_score_function == "sigmoid"
    grouped = spec.moe_router_num_groups is not None and spec.moe_router_num_groups > 1
    return dict(
        moe_router_score_function=spec.moe_router_score_function,
        # softmax: pre-softmax = softmax over all experts then top-k (norm_topk_prob=False); sigmoid
        # ignores the flag (megatron normalises sigmoid top-k gates itself).
        moe_router_pre_softmax=not sigmoid and not spec.moe_norm_topk_prob,
        moe_router_enable_expert_bias=spec.moe_router_expert_bias,
        moe_router_bias_update_rate=expert_bias_update_rate if update_expert_bias else 0.0,
        # one group = no group limit: skip the grouped path (it would select the single group anyway)
        moe_router_num_groups=spec.moe_router_num_groups if grouped else None,
        moe_router_group_topk=spec.moe_router_group_topk if grouped else None,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=spec.moe_shared_expert_gate,
        moe_layer_freq=moe_layer_freq(spec),
    )


def router_summary(spec: Any) -> str:
    """One line naming the router features of ``spec`` (``maspo plan`` / ``maspo check`` output)."""
    parts = [f"score={spec.moe_router_score_function}", f"top{spec.moe_router_topk}/{spec.num_moe_experts}"]
    if spec.moe_router_expert_bias:
        parts.append("correction_bias")
    if spec.moe_router_num_groups and spec.moe_router_num_groups > 1:
        parts.append(f"groups={spec.moe_router_group_topk}/{spec.moe_router_num_groups}")
    if spec.moe_router_topk_scaling_factor:
        parts.append(f"scale={spec.moe_router_topk_scaling_factor:g}")
    if spec.moe_shared_expert_intermediate_size:
        parts.append(f"shared={spec.moe_shared_expert_intermediate_size}")
    if spec.moe_first_k_dense:
        parts.append(f"dense_first={spec.moe_first_k_dense}")
    return "router: " + " ".join(parts)
