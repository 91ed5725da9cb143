"""The declaration of one model family: everything the package knows about it, in one value.

A family module (``model/families/<family>.py``) builds one :class:`ModelFamily`; ``registry.py`` collects
them, and the lists the rest of the package reads (``model.spec.SUPPORTED_FAMILIES``,
``conversion.families.FAMILY_TABLES``, ``model.hf_config.HF_MODEL_TYPES``, ``model.tiny_hf.TINY_DEFAULTS``,
``model.presets.PRESETS``) are views of the registry. Plain data and callables, no torch, no transformers,
no ``ArchSpec`` import: the callables receive an ``ArchSpec`` or a transformers config and return plain
dicts, so ``model/spec.py`` can read the registry without an import cycle.

The fields under "next families" describe what DeepSeek-V3 (MLA, dense first layers, MTP), GLM-4.5 and
Qwen3.5 (hybrid linear attention, a multimodal wrapper, fused experts on disk) need. They have defaults
that mean "as today's families" and no reader yet: the issues adding those families give them one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_maspo.model.families.names import Entry, FamilyTable

SpecFields = dict[str, Any]
"""Keyword arguments of ``ArchSpec`` (without ``family``, filled by the registry's reader)."""

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""``config.json`` keys every family carries through ``ArchSpec.extra`` unchanged."""


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is: its attention and its MLP."""

    attention: Literal["full", "linear", "mla"] = "full"
    """``"full"`` softmax attention (today's families), ``"linear"`` (Qwen3.5's Gated DeltaNet: recurrent
    state instead of a KV cache) or ``"mla"`` (DeepSeek-V3's multi-latent attention)."""
    mlp: Literal["dense", "moe"] = "dense"
    """``"dense"`` gated MLP or ``"moe"`` routed experts (DeepSeek-V3 / GLM-4.5: dense first layers)."""


@dataclass(frozen=True)
class Nesting:
    """Where a multimodal wrapper keeps its text model (Qwen3.5's ``Qwen3_5ForConditionalGeneration``)."""

    config_key: str = "text_config"
    """Key of the HF ``config.json`` that holds the text model's config; the mapping reads it."""
    hf_prefix: str = "model.language_model."
    """Prefix of the text model's safetensors keys in the wrapper's checkpoint."""
    table_prefix: str = "model."
    """The prefix the family's name table is written with; replaced by ``hf_prefix`` on the HF side."""


@dataclass(frozen=True)
class FusedExperts:
    """Experts stored fused on disk, one tensor per layer (conversion-rules.md §9), split per expert on
    load and joined on export."""

    gate_up: str
    """HF name template of ``[E, 2I, H]`` (gate rows first), e.g. ``model.layers.{layer}.mlp.experts.gate_up_proj``."""
    down: str
    """HF name template of ``[E, H, I]``."""


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family, declared once.

    The four built-in families (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``) share the Llama-style
    decoder (``llama_style.py``) and differ in the flags, the MoE mapping and their presets.
    """

    name: str
    """``ArchSpec.family``; the key of every derived list."""
    display_name: str
    """How error messages name the HF family (``"Qwen2"``)."""
    model_types: tuple[str, ...]
    """HF ``model_type`` values read as this family; the first is written on export."""
    architectures: tuple[str, ...]
    """HF ``architectures`` class names accepted; the first is written on export and names the
    transformers class the tiny model is built with."""
    names: FamilyTable
    """The HF <-> Megatron name table (``names.py`` entries; ``conversion/`` reads it)."""
    from_hf: Callable[[Any, dict], SpecFields]
    """``(transformers config with its defaults filled, the raw config.json dict)`` -> ``ArchSpec``
    fields; raises ``ValueError`` naming the field for anything Megatron-Core cannot reproduce exactly.
    ``qk_layernorm``, the token ids in ``extra`` (merged with any ``extra`` it returns) and (for
    ``qkv_bias="always"``) ``add_qkv_bias`` are then set by the reader."""
    to_hf: Callable[[Any], dict[str, Any]]
    """``ArchSpec`` -> ``config.json`` content (without ``model_type``/``architectures``/``attention_bias``,
    which the reader adds from the declaration and the flags); raises ``ValueError`` for a spec the HF
    family cannot express."""
    qkv_bias: Literal["config", "always"] = "config"
    """``"config"``: HF ``attention_bias`` decides (written on export); ``"always"``: the HF family has
    q/k/v biases with no config key (Qwen2), so a spec without them is refused on export."""
    qk_norm: bool | Literal["config"] = False
    """True: the HF family always has q/k RMSNorm (Qwen3), a spec disagreeing is refused on export;
    ``"config"``: a config key decides (GLM-4.5's ``use_qk_norm``): ``from_hf`` sets ``qk_layernorm`` and
    ``to_hf`` writes the key; False: never."""
    moe: bool = False
    """The family has routed experts (``from_hf`` fills the ``moe_*`` fields); a dense family refuses a
    spec with experts on export."""
    shared_experts: bool = False
    """The family's HF config can express always-on shared experts
    (``ArchSpec.moe_shared_expert_intermediate_size``); otherwise a spec with them is refused on export."""
    tiny: Mapping[str, Any] = field(default_factory=dict)
    """HF config fields of the family's tiny random test model (``model.tiny_hf.make_tiny_hf_model``);
    ``vocab_size`` is the builder's argument. Empty: the family has no tiny model."""
    presets: Mapping[str, SpecFields] = field(default_factory=dict)
    """Published checkpoints by lower-case HF name (``model.arch``): ``ArchSpec`` fields, exact
    ``config.json`` shapes (``tests/unit/launch/test_presets.py`` checks the parameter counts)."""
    planning_layouts: Mapping[str, SpecFields] = field(default_factory=dict)
    """Layouts that are no published checkpoint (no HF round trip): ``model.arch`` for ``maspo plan`` only."""

    # ---- next families: defaults mean "as today's families"; nothing reads them yet ----
    layer_kinds: Callable[[Any], tuple[LayerKind, ...]] | None = None
    """transformers config -> one :class:`LayerKind` per layer (DeepSeek-V3's ``first_k_dense_replace``,
    Qwen3.5's ``layer_types``). None: every layer is ``full`` attention, ``moe`` iff the spec has experts."""
    layer_names_by_kind: Mapping[str, tuple[Entry, ...]] = field(default_factory=dict)
    """Name-table entries of layers of one kind, keyed by a ``LayerKind.attention`` or ``LayerKind.mlp``
    value (``"linear"``, ``"mla"``, ``"dense"``, ``"moe"``), used with ``names.layer`` for layers of that
    kind. Empty: ``names.layer`` serves every layer."""
    nesting: Nesting | None = None
    """The text model sits inside a multimodal wrapper (nested ``text_config``, key prefix). None: the
    checkpoint is a plain causal LM."""
    fused_experts: FusedExperts | None = None
    """Experts are fused on disk. None: per-expert keys (what ``save_pretrained`` writes for Qwen3-MoE)."""
    passthrough: tuple[str, ...] = ()
    """HF key prefixes kept by name, unconverted, from import to export (MTP layers ``"mtp."``, a vision
    tower ``"model.visual."``). Empty: every key must be in the name table."""
    recurrent_state_bytes: Callable[[Any, int], int] | None = None
    """``(spec, bytes per element)`` -> bytes of recurrent state one in-flight sequence holds over all
    linear-attention layers (conv + delta state), which the planner adds to the KV cache of the full
    ones. None: the generation cache is KV per token only."""
