"""Hugging Face ``config.json`` <-> :class:`ArchSpec` (conversion-rules.md §8), read from the family registry.

Each family's declaration (``model/families/<family>.py``) holds its HF model types, architectures and
config mapping; this module finds the family and applies what every family shares (the ``architectures``
check, transformers' defaults, the feature flags, token ids). Only registered families are accepted;
anything Megatron-Core cannot reproduce exactly (sliding windows, non-SiLU MLPs, llama3 rope scaling
with parameters other than the ones megatron-core hard-codes, MoE layers interleaved with dense ones) is
refused with a ``ValueError`` naming the field, rather than converted into a silently different model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_maspo.model.families.declaration import TOKEN_ID_KEYS
from megatron_maspo.model.families.llama_style import MEGATRON_LLAMA3_ROPE
from megatron_maspo.model.families.registry import (
    LiveMapping,
    families,
    family_of_model_type,
    get_family,
)
from megatron_maspo.model.spec import ArchSpec

logger = logging.getLogger(__name__)

__all__ = ["HF_MODEL_TYPES", "MEGATRON_LLAMA3_ROPE", "arch_spec_from_hf", "hf_config_dict"]

HF_MODEL_TYPES: LiveMapping[tuple[str, str]] = LiveMapping(
    lambda: {t: (f.name, f.architectures[0]) for f in families() for t in f.model_types})
"""HF model_type -> (ArchSpec.family, CausalLM class name written to ``architectures``); a registry view."""


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"no HF config.json at {path}")
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers PretrainedConfig, a dict or a folder path; "
                    f"got {type(config).__name__}")


def arch_spec_from_hf(config: Any) -> ArchSpec:
    """Build an :class:`ArchSpec` from an HF config.

    Args:
        config: a transformers ``PretrainedConfig``, its ``to_dict()``, or a folder (or file) holding
            ``config.json``.

    Raises:
        ValueError: unsupported ``model_type``/``architectures`` or a feature Megatron cannot
            reproduce exactly; the message names the field.
    """
    d = _as_dict(config)
    model_type = d.get("model_type")
    family = family_of_model_type(model_type)
    archs = d.get("architectures") or [family.architectures[0]]
    if len(archs) != 1 or archs[0] not in family.architectures:
        raise ValueError(f"HF architectures={archs} is not supported for model_type={model_type!r}; "
                         f"accepted: {list(family.architectures)}")
    # Fill transformers' own defaults for keys a hand-written dict leaves out.
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    fields = family.from_hf(cfg, d)
    if family.qkv_bias == "always":  # e.g. Qwen2: q/k/v biases with no config key
        fields["add_qkv_bias"] = True
    if family.qk_norm != "config":
        fields["qk_layernorm"] = bool(family.qk_norm)
    extra = {k: d[k] for k in TOKEN_ID_KEYS if d.get(k) is not None} | fields.pop("extra", {})
    return ArchSpec(family=family.name, extra=extra, **fields)


def hf_config_dict(spec: ArchSpec) -> dict:
    """``config.json`` content for ``spec``, loadable by ``AutoConfig``/``AutoModelForCausalLM``.

    Raises:
        ValueError: ``spec`` has a feature its family's HF config cannot express (shared experts, experts
            in a dense family, q/k norms or QKV biases the HF family always or never has).
    """
    family = get_family(spec.family)
    if spec.moe_shared_expert_intermediate_size and not family.shared_experts:
        raise ValueError(f"ArchSpec.moe_shared_expert_intermediate_size is set but HF {family.display_name} "
                         f"(family {spec.family!r}) has no shared experts")
    name = f"ArchSpec(family={spec.family!r})"
    if family.qkv_bias == "always" and not spec.add_qkv_bias:
        raise ValueError(f"{name}.add_qkv_bias=False: HF {family.display_name} always has QKV biases")
    if family.qk_norm is True and not spec.qk_layernorm:
        raise ValueError(f"{name}.qk_layernorm=False: HF {family.display_name} always has q/k norms")
    if not family.qk_norm and spec.qk_layernorm:
        raise ValueError(f"{name}.qk_layernorm=True has no HF equivalent")
    if spec.is_moe and not family.moe:
        moe = [f.name for f in families() if f.moe]
        raise ValueError(f"{name} has num_moe_experts set; only {', '.join(moe)} {'is' if len(moe) == 1 else 'are'} MoE")
    d: dict[str, Any] = {"model_type": family.model_types[0], "architectures": [family.architectures[0]],
                         **family.to_hf(spec)}
    if family.qkv_bias == "config":
        d["attention_bias"] = spec.add_qkv_bias
    return d
