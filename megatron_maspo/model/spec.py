"""Architecture description shared by the model provider, the converters and the planner.

:class:`ArchSpec` holds a decoder-only transformer in Megatron's vocabulary. It is plain data (no
megatron import) so the planner and the conversion tables can use it cheaply. ``hf_config.py`` builds
one from a Hugging Face config; ``provider.py`` turns one into a Megatron-Core ``GPTModel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_maspo.model.families.registry import LiveNames, family_names

SUPPORTED_FAMILIES = LiveNames(family_names)
"""The registered model families (``model/families/``), a live view: a family registered later is in it."""


@dataclass(kw_only=True)
class ArchSpec:
    """A decoder-only GPT architecture, in Megatron terms.

    Field names follow ``TransformerConfig`` / ``GPTModel`` where one exists.
    """

    family: str
    """One of ``SUPPORTED_FAMILIES`` (a family declared in ``model/families/``); selects its HF config
    mapping, its name table in ``conversion/`` and its presets."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    """Dense MLP width (HF ``intermediate_size``)."""
    num_attention_heads: int
    num_query_groups: int
    """KV heads (HF ``num_key_value_heads``); GQA when < ``num_attention_heads``."""
    kv_channels: int
    """Head dimension (HF ``head_dim``; Qwen3's is not hidden/heads)."""
    vocab_size: int
    """Unpadded vocabulary size V (HF ``vocab_size``)."""
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: str | None = None
    """None, ``"llama3"`` (megatron hard-codes low=1, high=4, original=8192) or ``"linear"``."""
    rope_scaling_factor: float = 1.0
    layernorm_epsilon: float = 1e-6
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_norm_topk_prob: bool = True
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(x · w_gate)`` (Qwen2/3.5-MoE ``shared_expert_gate``)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer ``"full"`` (softmax attention) or ``"linear"`` (Gated DeltaNet, Qwen3.5); None = all full."""
    linear_attention: dict | None = None
    """``model.gdn_layout.GdnDims`` fields of the linear-attention layers (required when any layer is linear)."""
    attention_output_gate: bool = False
    """Full attention's output is multiplied by ``sigmoid(gate)``, a second query-sized projection (Qwen3.5)."""
    zero_centered_norm: bool = False
    """RMSNorms (layers, q/k, final) scale by ``1 + w`` with ``w`` stored zero-centred (Qwen3.5)."""
    extra: dict = field(default_factory=dict)
    """Family-specific values carried through for export (e.g. ``bos_token_id``)."""

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"ArchSpec.family={self.family!r} is not supported; accepted: {list(SUPPORTED_FAMILIES)}"
            )
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "kv_channels", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ArchSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ArchSpec.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.rope_scaling not in (None, "llama3", "linear"):
            raise ValueError(f"ArchSpec.rope_scaling={self.rope_scaling!r}; accepted: None, 'llama3', 'linear'")
        if self.is_moe and not self.moe_ffn_hidden_size:
            raise ValueError("ArchSpec.moe_ffn_hidden_size is required when num_moe_experts is set")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "linear"}:
                raise ValueError(f"ArchSpec.layer_types must list 'full' or 'linear' for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types}")
            if "linear" in self.layer_types and not self.linear_attention:
                raise ValueError("ArchSpec.linear_attention (GdnDims fields) is required with linear layers")

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (Gated DeltaNet)."""
        return bool(self.layer_types) and "linear" in self.layer_types  # type: ignore[operator]

    def layer_kind(self, layer: int) -> str:
        """``"full"`` or ``"linear"`` for global layer ``layer``."""
        return self.layer_types[layer] if self.layer_types else "full"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocabulary rows in Megatron's embedding: V rounded up to a multiple of ``divisible_by*tp``."""
        m = divisible_by * tp
        return ((self.vocab_size + m - 1) // m) * m

    def num_parameters(self) -> int:
        """Parameter count of the HF model (unpadded vocab, embeddings counted once if tied)."""
        h, nh, g, d = self.hidden_size, self.num_attention_heads, self.num_query_groups, self.kv_channels
        attn = h * nh * d + 2 * h * g * d + nh * d * h
        if self.add_qkv_bias:
            attn += nh * d + 2 * g * d
        if self.qk_layernorm:
            attn += 2 * d
        if self.is_moe:
            assert self.num_moe_experts and self.moe_ffn_hidden_size
            mlp = self.num_moe_experts * 3 * h * self.moe_ffn_hidden_size + h * self.num_moe_experts
            if self.moe_shared_expert_intermediate_size:
                mlp += 3 * h * self.moe_shared_expert_intermediate_size + h
        else:
            mlp = 3 * h * self.ffn_hidden_size
        if self.attention_output_gate:
            attn += h * nh * d
        n_linear = sum(1 for k in (self.layer_types or ()) if k == "linear")
        total = (self.num_layers - n_linear) * (attn + mlp + 2 * h) + n_linear * (mlp + 2 * h)
        if n_linear:
            from megatron_maspo.model.gdn_dims import GdnDims

            total += n_linear * GdnDims(**self.linear_attention).num_parameters(h)  # type: ignore[arg-type]
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    def validate_layout(self, tp: int, pp: int, ep: int = 1, vpp: int | None = None, *,
                        sequence_parallel: bool = False) -> None:
        """Raise ``ValueError`` naming the constraint if this model cannot be split this way.

        ``sequence_parallel``: the run uses Megatron sequence parallelism (TE spec), which MoE needs
        at TP > 1."""
        if self.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"tensor_model_parallel_size={tp}")
        if self.num_query_groups % tp and tp % self.num_query_groups:
            raise ValueError(f"num_query_groups={self.num_query_groups} and tensor_model_parallel_size="
                             f"{tp}: one must divide the other")
        if self.num_query_groups < tp:
            # Megatron requires num_query_groups % tp == 0 for its own GQA split.
            raise ValueError(f"num_query_groups={self.num_query_groups} < tensor_model_parallel_size={tp}:"
                             " Megatron-Core cannot shard fewer KV heads than TP ranks")
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            raise ValueError(f"num_layers={self.num_layers} is not divisible by pipeline stages x "
                             f"virtual chunks = {pp} x {vpp or 1}")
        if self.is_hybrid:
            from megatron_maspo.model.gdn_dims import GdnDims

            GdnDims(**self.linear_attention).check_tp(tp)  # type: ignore[arg-type]
        if self.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp={tp}")
        if self.is_moe:
            assert self.num_moe_experts
            if self.num_moe_experts % ep:
                raise ValueError(f"num_moe_experts={self.num_moe_experts} is not divisible by "
                                 f"expert_model_parallel_size={ep}")
            if tp > 1 and not sequence_parallel:
                raise ValueError("MoE with tensor_model_parallel_size > 1 needs sequence parallelism "
                                 "(Megatron refuses MoE+TP training without it), which only the Transformer "
                                 "Engine spec provides (model.attention_backend='te', GPU); the local spec "
                                 "(CPU) runs MoE at TP=1 with EP")
        elif ep != 1:
            raise ValueError(f"expert_model_parallel_size={ep} given for a dense model")


def tiny_qwen2_spec(vocab_size: int = 384, *, num_layers: int = 2, hidden_size: int = 64,
                    tie_word_embeddings: bool = True) -> ArchSpec:
    """A tiny Qwen2-style model (GQA, QKV bias, RMSNorm, SwiGLU, rotary) for tests and the CPU default."""
    return ArchSpec(family="qwen2", num_layers=num_layers, hidden_size=hidden_size,
                    ffn_hidden_size=hidden_size * 3, num_attention_heads=4, num_query_groups=2,
                    kv_channels=hidden_size // 4, vocab_size=vocab_size, max_position_embeddings=512,
                    rotary_base=10000.0, layernorm_epsilon=1e-6, add_qkv_bias=True,
                    tie_word_embeddings=tie_word_embeddings)
