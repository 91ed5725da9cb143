"""The DeepSeekMoE block shared by DeepSeek-V3 and GLM-4.5: HF config fields both ways and name-table entries.

HF (``transformers`` ``deepseek_v3`` / ``glm4_moe``, safetensors keys as ``save_pretrained`` writes them)::

    model.layers.{i}.mlp.gate.weight                      [E, H]   router (kept fp32 in training)
    model.layers.{i}.mlp.gate.e_score_correction_bias     [E]      fp32 correction bias (selection only)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight    routed experts, per-expert keys
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight shared expert (n_shared_experts wide)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight       dense MLP of the first_k_dense_replace layers

Megatron (local spec): ``mlp.router.weight``, ``mlp.router.expert_bias`` (a persistent buffer),
``mlp.experts.local_experts.{j}.linear_fc{1,2}``, ``mlp.shared_experts.linear_fc{1,2}`` (TP-split like a
dense MLP) and, in dense layers, ``mlp.linear_fc{1,2}``. The maths each field carries is in
``model/moe_router.py``. Torch-free.
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families.declaration import SpecFields
from megatron_maspo.model.families.names import Direct, Entry, GatedMLP

_H = "model.layers.{layer}.mlp."
_M = "decoder.layers.{layer}.mlp."
_E = _H + "experts.{expert}."
_LE = _M + "experts.local_experts.{local_expert}."
_S = _H + "shared_experts."

MLP: tuple[Entry, ...] = (
    # dense first layers (HF first_k_dense_replace)
    GatedMLP(_H + "gate_proj.weight", _H + "up_proj.weight", _M + "linear_fc1.weight", when="dense_layer"),
    Direct(_H + "down_proj.weight", _M + "linear_fc2.weight", split=1, when="dense_layer"),
    # MoE layers
    Direct(_H + "gate.weight", _M + "router.weight", when="moe_layer"),
    Direct(_H + "gate.e_score_correction_bias", _M + "router.expert_bias", when="expert_bias", fp32=True),
    GatedMLP(_E + "gate_proj.weight", _E + "up_proj.weight", _LE + "linear_fc1.weight", when="moe_layer"),
    Direct(_E + "down_proj.weight", _LE + "linear_fc2.weight", split=1, when="moe_layer"),
    GatedMLP(_S + "gate_proj.weight", _S + "up_proj.weight", _M + "shared_experts.linear_fc1.weight",
             when="shared_expert"),
    Direct(_S + "down_proj.weight", _M + "shared_experts.linear_fc2.weight", split=1, when="shared_expert"),
)
"""Every layer's MLP entries; the ``when`` of each picks the dense or the MoE set per layer (the
correction bias and the shared expert: MoE layers of a spec that has them)."""


def moe_fields_from_hf(cfg: Any) -> SpecFields:
    """``ArchSpec`` MoE fields of a DeepSeek-V3 / GLM-4.5 transformers config (defaults filled).

    Raises:
        ValueError: naming the HF field, for what megatron-core 0.16.1 cannot reproduce exactly:
            no shared expert, group-limited routing whose per-group score is not the top-2 sum HF uses
            (Megatron sums the top ``topk / topk_group``), or un-normalised sigmoid gates.
    """
    topk, groups, group_topk = cfg.num_experts_per_tok, int(cfg.n_group or 1), int(cfg.topk_group or 1)
    if not getattr(cfg, "n_shared_experts", 0):
        raise ValueError("n_shared_experts=0 is not supported (the name table has a shared expert)")
    if groups > 1 and topk != 2 * group_topk:
        raise ValueError(f"n_group={groups} with num_experts_per_tok={topk}, topk_group={group_topk}: HF scores a "
                         "group by its top-2 experts, megatron-core by its top num_experts_per_tok/topk_group; "
                         "they agree only when num_experts_per_tok == 2 * topk_group")
    if groups == 1 and group_topk != 1:
        raise ValueError(f"n_group=1 with topk_group={group_topk}: must be 1")
    if not cfg.norm_topk_prob and topk > 1:
        raise ValueError("norm_topk_prob=False is not supported: megatron-core 0.16.1 always normalises "
                         "top-k sigmoid gates")
    if not 0 <= cfg.first_k_dense_replace < cfg.num_hidden_layers:
        raise ValueError(f"first_k_dense_replace={cfg.first_k_dense_replace} must be in [0, num_hidden_layers)")
    return dict(
        num_moe_experts=cfg.n_routed_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=topk,
        moe_norm_topk_prob=True,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
        moe_first_k_dense=int(cfg.first_k_dense_replace),
    )


def moe_config_json(spec: Any) -> dict[str, Any]:
    """The ``config.json`` MoE keys for ``spec``.

    Raises:
        ValueError: a spec the HF block cannot express (softmax routing, no correction bias, a shared
            expert that is not a whole number of routed-expert widths, or none).
    """
    shared = spec.moe_shared_expert_intermediate_size or 0
    if spec.moe_router_score_function != "sigmoid" or not spec.moe_router_expert_bias:
        raise ValueError(f"ArchSpec(family={spec.family!r}) needs a sigmoid router with a correction bias")
    if not shared or shared % spec.moe_ffn_hidden_size or spec.moe_shared_expert_gate:
        raise ValueError(f"ArchSpec(family={spec.family!r}).moe_shared_expert_intermediate_size={shared} is not "
                         f"an ungated multiple of moe_ffn_hidden_size={spec.moe_ffn_hidden_size}")
    return {
        "n_routed_experts": spec.num_moe_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "n_shared_experts": shared // spec.moe_ffn_hidden_size,
        "routed_scaling_factor": spec.moe_router_topk_scaling_factor or 1.0,
        "n_group": spec.moe_router_num_groups or 1,
        "topk_group": spec.moe_router_group_topk or 1,
        "norm_topk_prob": spec.moe_norm_topk_prob,
        "first_k_dense_replace": spec.moe_first_k_dense,
    }
