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
    """None, ``"llama3"`` (megatron hard-codes low=1, high=4, original=8192), ``"linear"`` or ``"yarn"``
    (multi-latent attention only: megatron-core applies YaRN inside ``MLASelfAttention``)."""
    rope_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int | None = None
    """YaRN: the pre-training context (HF ``rope_parameters["original_max_position_embeddings"]``)."""
    yarn_beta_fast: float = 32.0
    """YaRN β_fast (rotations above which a dimension is extrapolated); paper and DeepSeek-V3: 32."""
    yarn_beta_slow: float = 1.0
    """YaRN β_slow (rotations below which a dimension is interpolated); paper and DeepSeek-V3: 1."""
    yarn_mscale: float = 1.0
    """YaRN ``mscale``: cos/sin are multiplied by ``m(s, mscale) / m(s, mscale_all_dim)`` with
    ``m(s, a) = 0.1·a·ln s + 1`` (``s`` = ``rope_scaling_factor``); DeepSeek-V3: 1.0."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN ``mscale_all_dim``: the softmax scale is ``m(s, mscale_all_dim)² / sqrt(d_qk)``; 0 leaves it
    at ``1/sqrt(d_qk)``. DeepSeek-V3: 1.0."""
    layernorm_epsilon: float = 1e-6
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_norm_topk_prob: bool = True
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the always-on shared expert(s) (HF ``moe_intermediate_size * n_shared_experts``)."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate ``[1, H]`` (Qwen2-MoE; not DeepSeek/GLM)."""
    moe_router_score_function: str = "softmax"
    """``"softmax"`` (Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3, GLM-4.5): s_i = sigmoid(h . w_i)."""
    moe_router_expert_bias: bool = False
    """The router holds an fp32 score-correction bias b (HF ``e_score_correction_bias``) added to the
    scores for top-k selection only: experts = topk(s + b), gate weights from s (DeepSeek-V3 §2.1.2)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (HF ``n_group``): experts split into this many equal groups; None = off."""
    moe_router_group_topk: int | None = None
    """Groups kept per token (HF ``topk_group``); each group is scored by its top-(topk / group_topk) scores."""
    moe_router_topk_scaling_factor: float | None = None
    """Routed gate weights multiplied by this (HF ``routed_scaling_factor``); None = 1."""
    moe_first_k_dense: int = 0
    """The first k layers have a dense MLP of ``ffn_hidden_size`` instead of experts (HF
    ``first_k_dense_replace``); Megatron's ``moe_layer_freq = [0]*k + [1]*(L-k)``."""
    kv_lora_rank: int | None = None
    """Multi-latent attention (DeepSeek-V2/V3, HF ``kv_lora_rank``): rank of the compressed KV latent
    ``c_kv`` that K and V are expanded from; None = standard attention (every other MLA field unused).
    With MLA, ``kv_channels`` is the value head dim and ``num_query_groups`` equals the heads."""
    q_lora_rank: int | None = None
    """MLA: rank of the query's low-rank projection (HF ``q_lora_rank``: ``q_a_proj`` -> RMSNorm ->
    ``q_b_proj``); None = one full ``q_proj`` (DeepSeek-V2-Lite)."""
    qk_head_dim: int = 0
    """MLA: per-head query/key dims without rotary (HF ``qk_nope_head_dim``; DeepSeek-V3: 128)."""
    qk_pos_emb_head_dim: int = 0
    """MLA: per-head rotary dims, the key's shared by all heads (HF ``qk_rope_head_dim``; 64)."""
    mla_rope_interleave: bool = True
    """MLA: the HF checkpoint lays each head's rotary dims out as interleaved pairs (HF ``rope_interleave``,
    DeepSeek-V3: True), which is what megatron-core's MLA RoPE de-interleaves; False (rotate-half
    layout) makes conversion interleave those weight rows on import and undo it on export."""
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
        if self.rope_scaling not in (None, "llama3", "linear", "yarn"):
            raise ValueError(f"ArchSpec.rope_scaling={self.rope_scaling!r}; accepted: None, 'llama3', 'linear', "
                             "'yarn'")
        if self.is_mla:
            _check_mla(self)
        elif self.rope_scaling == "yarn":
            raise ValueError("ArchSpec.rope_scaling='yarn' is implemented for multi-latent attention only "
                             "(kv_lora_rank set)")
        if self.is_moe and not self.moe_ffn_hidden_size:
            raise ValueError("ArchSpec.moe_ffn_hidden_size is required when num_moe_experts is set")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "linear"}:
                raise ValueError(f"ArchSpec.layer_types must list 'full' or 'linear' for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types}")
            if "linear" in self.layer_types and not self.linear_attention:
                raise ValueError("ArchSpec.linear_attention (GdnDims fields) is required with linear layers")
        if self.is_moe:
            from megatron_maspo.model.moe_router import validate_router

            validate_router(self)

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (Gated DeltaNet)."""
        return bool(self.layer_types) and "linear" in self.layer_types  # type: ignore[operator]

    def layer_kind(self, layer: int) -> str:
        """``"full"`` or ``"linear"`` for global layer ``layer``."""
        return self.layer_types[layer] if self.layer_types else "full"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts."""
        return self.is_moe and layer >= self.moe_first_k_dense

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe_first_k_dense if self.is_moe else 0

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocabulary rows in Megatron's embedding: V rounded up to a multiple of ``divisible_by*tp``."""
        m = divisible_by * tp
        return ((self.vocab_size + m - 1) // m) * m

    def num_parameters(self) -> int:
        """Parameter count of the HF model (unpadded vocab, embeddings counted once if tied)."""
        h, nh, g, d = self.hidden_size, self.num_attention_heads, self.num_query_groups, self.kv_channels
        attn = h * nh * d + 2 * h * g * d + nh * d * h
        if self.is_mla:
            attn = mla_attention_parameters(self)
        elif self.add_qkv_bias:
            attn += nh * d + 2 * g * d
        if self.qk_layernorm:
            attn += 2 * d
        dense_mlp = 3 * h * self.ffn_hidden_size
        moe_mlp = 0
        if self.is_moe:
            assert self.num_moe_experts and self.moe_ffn_hidden_size
            e = self.num_moe_experts
            moe_mlp = e * 3 * h * self.moe_ffn_hidden_size + h * e + (e if self.moe_router_expert_bias else 0)
            if self.moe_shared_expert_intermediate_size:
                moe_mlp += 3 * h * self.moe_shared_expert_intermediate_size
                moe_mlp += h if self.moe_shared_expert_gate else 0
        if self.attention_output_gate:
            attn += h * nh * d
        n_moe = self.num_moe_layers
        n_linear = sum(1 for k in (self.layer_types or ()) if k == "linear")
        # every layer: its MLP (dense, or routed experts from moe_first_k_dense on) and two norms; full
        # attention layers add attention, linear (Gated DeltaNet) layers their mixer
        total = ((self.num_layers - n_moe) * dense_mlp + n_moe * moe_mlp + self.num_layers * 2 * h
                 + (self.num_layers - n_linear) * attn)
        if n_linear:
            from megatron_maspo.model.gdn_dims import GdnDims

            total += n_linear * GdnDims(**self.linear_attention).num_parameters(h)  # type: ignore[arg-type]
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    def validate_layout(self, tp: int, pp: int, ep: int = 1, vpp: int | None = None, *,
                        sequence_parallel: bool = False, pp_first: int | None = None,
                        pp_last: int | None = None) -> None:
        """Raise ``ValueError`` naming the constraint if this model cannot be split this way.

        ``sequence_parallel``: the run uses Megatron sequence parallelism (TE spec), which MoE needs
        at TP > 1. ``pp_first`` / ``pp_last``: layers of the first / last pipeline stage of an uneven
        split (``parallel/pipeline_split.py``), None = even."""
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
        from megatron_maspo.parallel.pipeline_split import PipelineSplit

        PipelineSplit(self.num_layers, pp, vpp, pp_first, pp_last)  # raises naming the fix
        if self.is_hybrid:
            from megatron_maspo.model.gdn_dims import GdnDims

            GdnDims(**self.linear_attention).check_tp(tp)  # type: ignore[arg-type]
        if self.is_mla:
            for name in ("q_lora_rank", "kv_lora_rank"):
                # column-parallel down projections, gathered after the matmul (MLASelfAttention)
                rank = getattr(self, name) or 0
                rows = rank + (self.qk_pos_emb_head_dim if name == "kv_lora_rank" else 0)
                if rows % tp:
                    raise ValueError(f"{name}={rank} (+ rotary dims for kv) gives {rows} rows of the MLA "
                                     f"down projection, not divisible by tensor_model_parallel_size={tp}")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp={tp}")
        if self.is_moe:
            assert self.num_moe_experts
            if self.num_moe_experts % ep:
                raise ValueError(f"num_moe_experts={self.num_moe_experts} is not divisible by "
                                 f"expert_model_parallel_size={ep}")
            if tp > 1 and not sequence_parallel:
                raise ValueError("MoE with tensor_model_parallel_size > 1 needs sequence parallelism "
                                 "(Megatron refuses MoE+TP training without it): leave "
                                 "parallel.sequence_parallel unset (on for MoE at TP > 1) or set it True")
        elif ep != 1:
            raise ValueError(f"expert_model_parallel_size={ep} given for a dense model")


def _check_mla(spec: ArchSpec) -> None:
    """The MLA fields of ``spec`` are complete and consistent (``ValueError`` naming the field)."""
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim"):
        if (getattr(spec, name) or 0) <= 0:
            raise ValueError(f"ArchSpec.{name} must be > 0 with multi-latent attention, got {getattr(spec, name)}")
    if spec.q_lora_rank is not None and spec.q_lora_rank <= 0:
        raise ValueError(f"ArchSpec.q_lora_rank must be > 0 or None, got {spec.q_lora_rank}")
    if spec.qk_pos_emb_head_dim % 2:
        raise ValueError(f"ArchSpec.qk_pos_emb_head_dim={spec.qk_pos_emb_head_dim} must be even (rotary pairs)")
    if spec.num_query_groups != spec.num_attention_heads:
        raise ValueError("multi-latent attention expands one key/value per head: num_query_groups="
                         f"{spec.num_query_groups} must equal num_attention_heads={spec.num_attention_heads}")
    if spec.rope_scaling not in (None, "yarn"):
        raise ValueError(f"ArchSpec.rope_scaling={spec.rope_scaling!r} with multi-latent attention; accepted: "
                         "None, 'yarn' (megatron-core's MLA has no llama3/linear scaling)")
    if spec.rope_scaling == "yarn" and not spec.yarn_original_max_position_embeddings:
        raise ValueError("ArchSpec.yarn_original_max_position_embeddings is required with rope_scaling='yarn'")
    if spec.qk_layernorm or spec.add_qkv_bias or spec.rotary_percent != 1.0:
        raise ValueError("multi-latent attention has no q/k norms, QKV bias or partial rotary "
                         "(qk_layernorm, add_qkv_bias, rotary_percent)")


def mla_attention_parameters(spec: ArchSpec) -> int:
    """Parameters of one MLA block: q (low-rank + norm, or full), KV down (+ rotary key) + norm, KV up, out."""
    h, nh = spec.hidden_size, spec.num_attention_heads
    qk = spec.qk_head_dim + spec.qk_pos_emb_head_dim
    kv = spec.kv_lora_rank or 0
    q = h * nh * qk if spec.q_lora_rank is None else spec.q_lora_rank * (h + 1 + nh * qk)
    return q + h * (kv + spec.qk_pos_emb_head_dim) + kv + kv * nh * (spec.qk_head_dim + spec.kv_channels) \
        + nh * spec.kv_channels * h


def tiny_qwen2_spec(vocab_size: int = 384, *, num_layers: int = 2, hidden_size: int = 64,
                    tie_word_embeddings: bool = True) -> ArchSpec:
    """A tiny Qwen2-style model (GQA, QKV bias, RMSNorm, SwiGLU, rotary) for tests and the CPU default."""
    return ArchSpec(family="qwen2", num_layers=num_layers, hidden_size=hidden_size,
                    ffn_hidden_size=hidden_size * 3, num_attention_heads=4, num_query_groups=2,
                    kv_channels=hidden_size // 4, vocab_size=vocab_size, max_position_embeddings=512,
                    rotary_base=10000.0, layernorm_epsilon=1e-6, add_qkv_bias=True,
                    tie_word_embeddings=tie_word_embeddings)
