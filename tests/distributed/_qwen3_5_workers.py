"""Rank functions for the Qwen3.5 conversion tests (module-level so spawn can pickle them)."""

from __future__ import annotations

import dataclasses

import torch

ABLATIONS = ("none", "linear_attention", "output_gate", "shared_expert_gate", "zero_centered_norm",
             "partial_rotary")
"""``none`` is the unablated model (must match); every other name removes one family feature."""


def _ablate(model: torch.nn.Module, name: str) -> int:
    """Remove feature ``name`` from a loaded model in place; returns how many modules it touched."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from megatron_maspo.model.gdn import GatedDeltaNet

    touched = 0
    for m in model.modules():
        if name == "linear_attention" and isinstance(m, GatedDeltaNet):
            m.forward = lambda h, *a, **k: (torch.zeros_like(h), None)  # the mixer's output removed
            touched += 1
        elif name == "output_gate" and isinstance(m, SelfAttention):
            m._apply_output_gate = lambda x, gate: x  # attention output no longer gated
            touched += 1
        elif name == "shared_expert_gate" and isinstance(m, SharedExpertMLP):
            m.use_shared_expert_gate = False
            touched += 1
    return touched


def ablation_errors(rank: int, world: int, hf_dir: str, tokens: torch.Tensor, ref: torch.Tensor,
                    names: list[str]) -> dict[str, float]:
    """Logits error vs ``ref`` of the TP 1 Megatron model with each feature in ``names`` removed.

    ``zero_centered_norm`` and ``partial_rotary`` are removed in the spec (plain ``w`` RMSNorms, full
    rotary: same parameters, so the HF weights still load); the others by disabling the module."""
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.conversion.plan import unwrap
    from megatron_maspo.conversion.verify import max_relative_error, megatron_logits
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel

    spec = arch_spec_from_hf(hf_dir)
    groups = init_parallel()
    out = {}
    for name in names:
        s = spec
        if name == "zero_centered_norm":
            s = dataclasses.replace(spec, zero_centered_norm=False)
        elif name == "partial_rotary":
            s = dataclasses.replace(spec, rotary_percent=1.0)
        chunks = build_model_chunks(s, ModelBuildOptions(), pp_rank=0)
        load_hf_weights(chunks, s, groups, hf_dir)
        if name not in ("none", "zero_centered_norm", "partial_rotary"):
            assert _ablate(unwrap(chunks[0]), name) > 0, f"{name}: nothing to remove"
        out[name] = max_relative_error(megatron_logits(chunks, s, groups, tokens), ref)
    return out
