"""Layer specs of hybrid models (Qwen3.5): Gated DeltaNet and gated full attention by ``layer_types``.

:func:`hybrid_block_spec` turns the local layer spec ``provider.layer_spec`` builds into a
``TransformerBlockSubmodules`` with one spec per layer of this pipeline stage (virtual chunk): a
``"linear"`` layer's ``self_attention`` is :class:`~megatron_maspo.model.gdn.GatedDeltaNet`, a
``"full"`` one keeps the local spec's attention, whose output gate (``attention_output_gate``),
partial rotary (``rotary_percent``) and q/k norms come from the ``TransformerConfig`` / ``GPTModel``
arguments the provider sets. With ``ArchSpec.zero_centered_norm`` every RMSNorm (layer input, pre-MLP,
q/k, final) is :class:`ZeroCenteredRMSNorm`; Megatron's local norm refuses
``layernorm_zero_centered_gamma``, so the flag is not set on the config.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from megatron_maspo.model.gdn_dims import GdnDims
from megatron_maspo.model.spec import ArchSpec


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``y = x / rms(x) · (1 + w)``, computed in fp32 and cast back; ``w`` starts at 0.

    Megatron's norm signature (``config, hidden_size, eps``). The weight is replicated over TP; in the
    q/k norms it is per head dimension, and Megatron's ``finalize_model_grads`` sums those
    (``q_layernorm``/``k_layernorm``) over TP like its own.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.config, self.eps = config, eps
        dev = None if getattr(config, "use_cpu_initialization", True) else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, device=dev,
                                                     dtype=getattr(config, "params_dtype", torch.float32)))
        if getattr(config, "sequence_parallel", False):
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def gdn_dims(spec: ArchSpec, **overrides: Any) -> GdnDims:
    """The linear-attention sizes of ``spec`` (``ArchSpec.linear_attention``)."""
    if not spec.linear_attention:
        raise ValueError(f"ArchSpec(family={spec.family!r}) has no linear_attention sizes")
    return GdnDims(**{**spec.linear_attention, **overrides})


def transformer_kwargs(spec: ArchSpec) -> dict[str, Any]:
    """``TransformerConfig`` fields of the hybrid features (empty for a plain spec)."""
    kw: dict[str, Any] = {}
    if spec.is_hybrid:
        from megatron_maspo.model.mcore_compat import per_layer_checkpoint_kwargs

        kw.update(per_layer_checkpoint_kwargs())  # layers differ: one checkpoint key per layer
    if spec.attention_output_gate:
        kw["attention_output_gate"] = True
    if spec.moe_shared_expert_gate:
        kw["moe_shared_expert_gate"] = True
    return kw


def needs_block_spec(spec: ArchSpec) -> bool:
    """Whether the model needs per-layer specs or the zero-centred norms (else the plain layer spec)."""
    return spec.is_hybrid or spec.zero_centered_norm


def _with_norms(layer: Any) -> Any:
    """A copy of the local layer spec with every RMSNorm zero-centred."""
    layer = copy.deepcopy(layer)
    sub = layer.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name, None) is not None:
            setattr(attn, name, ZeroCenteredRMSNorm)
    return layer


def hybrid_block_spec(spec: ArchSpec, tcfg: Any, layer: Any, *, vp_stage: int | None, pp_rank: int) -> Any:
    """``TransformerBlockSubmodules`` for this stage's layers of ``spec``.

    Args:
        spec: the architecture (``layer_types``, ``linear_attention``, ``zero_centered_norm``).
        tcfg: the ``TransformerConfig`` (its PP/VPP sizes give this stage's layer range).
        layer: the local layer spec (``provider.layer_spec``) full-attention layers use.
        vp_stage, pp_rank: this chunk's virtual stage and pipeline rank.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_maspo.model.gdn import GatedDeltaNet

    full = _with_norms(layer) if spec.zero_centered_norm else layer
    linear = None
    if spec.is_hybrid:
        linear = copy.deepcopy(full)
        linear.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"dims": gdn_dims(spec)})
    n = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    specs: list[Any] = [linear if spec.layer_kind(i) == "linear" else full for i in range(offset, offset + n)]
    norm: Any = ZeroCenteredRMSNorm if spec.zero_centered_norm else layer.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
