"""Per-architecture figures the planner's formulas use: parameters per GPU, activation, attention and KV
bytes, active parameters (pure maths; formulas in the docstring of ``launch/plan/estimator.py``).
"""

from __future__ import annotations

import math

from megatron_maspo.launch.plan.types import Layout
from megatron_maspo.model.spec import ArchSpec, mla_attention_parameters


def local_params(spec: ArchSpec, lay: Layout, divisible_by: int = 128) -> tuple[float, float]:
    """(non-expert, expert) parameters held by one GPU of the worst pipeline stage."""
    h, t = spec.hidden_size, lay.tp
    nh, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    attn = (h * nh * d * (2 if spec.attention_output_gate else 1) + 2 * h * g * d + nh * d * h) / t
    if spec.is_mla:
        # every MLA projection is TP-split on the local spec (model/mla.py); the two latent norms are not
        attn = (mla_attention_parameters(spec) - (spec.q_lora_rank or 0) - (spec.kv_lora_rank or 0)) / t \
            + (spec.q_lora_rank or 0) + (spec.kv_lora_rank or 0)
    elif spec.add_qkv_bias:
        attn += (nh * d + 2 * g * d) / t
    if spec.qk_layernorm:
        attn += 2 * d
    gdn = attn
    if spec.is_hybrid:  # linear layers hold a Gated DeltaNet instead of attention
        from megatron_maspo.model.gdn_dims import GdnDims

        dims = GdnDims(**spec.linear_attention)  # type: ignore[arg-type]
        gdn = (dims.num_parameters(h) - dims.value_head_dim) / t + dims.value_head_dim  # norm replicated
    dense_mlp = 3 * h * spec.ffn_hidden_size / t
    moe_mlp, moe_expert = 0.0, 0.0  # an MoE layer's router and shared expert; its routed experts
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        # experts are split over EP only: the trainer sets expert_tensor_parallel_size=1 (model/moe.py)
        moe_expert = spec.num_moe_experts * 3 * h * spec.moe_ffn_hidden_size / lay.ep
        moe_mlp = h * spec.num_moe_experts  # router weight (its fp32 correction bias is a buffer)
        if spec.moe_shared_expert_intermediate_size:  # Megatron's SharedExpertMLP: split over TP
            moe_mlp += 3 * h * spec.moe_shared_expert_intermediate_size / t
            moe_mlp += h if spec.moe_shared_expert_gate else 0
    emb = spec.padded_vocab_size(t, divisible_by) * h / t
    best = (0.0, 0.0)
    # the stage holding the most parameters (dense first layers sit on stage 0; hybrid stages mix kinds)
    for stage, layers in enumerate(stage_layers(spec.num_layers, lay.pp, lay.vpp, lay.pp_first, lay.pp_last)):
        n_moe = sum(spec.is_moe_layer(i) for i in layers)
        dense = sum((gdn if spec.layer_kind(i) == "linear" else attn) + 2 * h for i in layers)
        dense += n_moe * moe_mlp + (len(layers) - n_moe) * dense_mlp
        if lay.pp == 1:
            dense += emb * (1 if spec.tie_word_embeddings else 2) + h
        else:
            # Stage 0 holds the embedding, the last stage the output layer (a copy when tied) + final norm.
            dense += emb if stage == 0 else (emb + h if stage == lay.pp - 1 else 0)
        if dense + n_moe * moe_expert > sum(best):
            best = (dense, n_moe * moe_expert)
    return best


def stage_layers(num_layers: int, pp: int, vpp: int | None, first: int | None = None,
                 last: int | None = None) -> list[list[int]]:
    """Global layer ids of each pipeline stage, even or uneven (``parallel/pipeline_split.py``); a split
    Megatron refuses (reported by ``_layout_reasons``) is estimated as ``ceil(L / pp)`` consecutive layers."""
    from megatron_maspo.parallel.pipeline_split import PipelineSplit

    try:
        split = PipelineSplit(num_layers, pp, vpp, first, last)
    except ValueError:
        per = -(-num_layers // pp)
        return [list(range(s * per, min((s + 1) * per, num_layers))) for s in range(pp)]
    out: list[list[int]] = [[] for _ in range(pp)]
    for i in range(num_layers):
        out[split.stage_of(i)].append(i)
    return out


def activation_bytes(spec: ArchSpec, tp: int, recompute: str | None, elt: int,
                     sequence_parallel: bool = False) -> float:
    """Bytes kept per token per layer for the backward (module docstring formula)."""
    h, t = spec.hidden_size, tp
    sp = t if sequence_parallel else 1
    nh, g, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    if spec.is_moe:
        assert spec.moe_ffn_hidden_size and spec.num_moe_experts
        mlp = spec.moe_router_topk * (h + 3 * spec.moe_ffn_hidden_size) / t
        router = 4 * spec.num_moe_experts
    else:
        mlp, router = 3 * spec.ffn_hidden_size / t, 0
    qkv, ctx = nh * d + 2 * g * d, nh * d
    if spec.is_mla:  # q and the expanded K of d_n + d_r per head, V of d_v, plus the two latents
        qk = spec.qk_head_dim + spec.qk_pos_emb_head_dim
        qkv = 2 * nh * qk + nh * d + (spec.q_lora_rank or 0) * t + ((spec.kv_lora_rank or 0) + spec.qk_pos_emb_head_dim) * t
    full_set = elt * (4 * h / sp + qkv / t + ctx / t + mlp) + 4 * nh / t + router
    return elt * h / sp if recompute == "full" else full_set


def dense_attention_bytes(spec: ArchSpec, lay: Layout, seq: int, inflight: float, elt: int) -> float:
    """Bytes the dense block-causal-mask path adds per GPU for rows of ``seq`` tokens (module docstring)."""
    heads, s2 = spec.num_attention_heads / lay.tp, float(seq) ** 2
    upcast = 4 if elt < 4 else 0
    per_layer = (4 + elt if elt < 4 else 4) * heads * s2
    layers = inflight * lay.stage_layer_count(spec.num_layers) if lay.recompute is None else 1
    return inflight * s2 + layers * per_layer + (2 * elt + upcast) * heads * s2


def kv_bytes_per_token(spec: ArchSpec, vllm_tp: int) -> float:
    """bf16 K and V of the softmax-attention layers for one token on one engine GPU (KV heads replicate
    when vllm_tp > n_g); linear-attention layers (Qwen3.5's Gated DeltaNet) keep no per-token cache.

    Multi-latent attention caches the compressed latent and the shared rotary key instead,
    ``(kv_lora_rank + qk_rope_head_dim)`` elements per layer and token (DeepSeek-V2 paper, arXiv 2405.04434,
    §2.1.2 and Table 1: ``(d_c + d_h^R)·l``), the same on every TP rank (vLLM's MLA backends keep the latent
    whole: ``vllm/attention/backends/mla``); decode reads it once per token (``estimator.py``).
    """
    if spec.is_mla:
        return spec.num_layers * ((spec.kv_lora_rank or 0) + spec.qk_pos_emb_head_dim) * 2
    heads = max(1, math.ceil(spec.num_query_groups / vllm_tp))
    full = sum(1 for i in range(spec.num_layers) if spec.layer_kind(i) == "full")
    return 2 * full * heads * spec.kv_channels * 2


def recurrent_state_bytes(spec: ArchSpec, vllm_tp: int) -> float:
    """bf16 decode state one sequence holds in the linear-attention layers on one engine GPU (delta state
    and conv window, split by heads over the engine's TP); 0 for models without such layers."""
    from megatron_maspo.model.families.registry import get_family

    per_seq = get_family(spec.family).recurrent_state_bytes
    return per_seq(spec, 2) / vllm_tp if per_seq is not None else 0.0


def cache_bytes_per_sequence(spec: ArchSpec, vllm_tp: int, tokens: float) -> float:
    """Generation cache of one sequence of ``tokens`` tokens on one engine GPU: KV per token for the
    softmax layers plus the fixed recurrent state of the linear ones."""
    return tokens * kv_bytes_per_token(spec, vllm_tp) + recurrent_state_bytes(spec, vllm_tp)


ENGINE_WEIGHT_BYTES = {None: 2.0, "fp8": 1.0}
"""Bytes per quantised weight element on an engine (``rollout.vllm_quantization``): bf16, or FP8 e4m3 with
one fp32 scale per weight tensor (vLLM's online dynamic FP8, ``Fp8LinearMethod`` / ``Fp8MoEMethod`` with
an unserialised checkpoint: per-tensor weight scales; the scales are a few bytes per tensor, not counted)."""


def engine_unquantised_params(spec: ArchSpec) -> float:
    """Parameters an FP8 engine keeps in bf16: the embedding and LM head (vLLM's vocab layers take no FP8
    method), the routers (the MoE gate is built without a quantisation config) and the norms."""
    h = spec.hidden_size
    emb = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    routers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers)) * h * (spec.num_moe_experts or 0)
    return float(emb + routers + (2 * spec.num_layers + 1) * h)


def engine_weight_bytes(spec: ArchSpec, vllm_tp: int, quantization: str | None = None) -> float:
    """Weight bytes one engine GPU holds (and a decode step reads at most): ``1/vllm_tp`` of the model,
    bf16, or FP8 for every linear weight under ``quantization="fp8"`` (:data:`ENGINE_WEIGHT_BYTES`)."""
    p = float(spec.num_parameters())
    if not quantization:
        return 2 * p / vllm_tp
    kept = engine_unquantised_params(spec)
    return (2 * kept + ENGINE_WEIGHT_BYTES[quantization] * (p - kept)) / vllm_tp


def engine_expert_bytes(spec: ArchSpec, vllm_tp: int, quantization: str | None = None) -> float:
    """Routed-expert weight bytes one engine GPU holds (the part of :func:`engine_weight_bytes` a decode
    step reads only for the experts its tokens touch); 0 for dense models."""
    if not spec.is_moe:
        return 0.0
    assert spec.num_moe_experts and spec.moe_ffn_hidden_size
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    per = ENGINE_WEIGHT_BYTES[quantization] if quantization else 2.0
    return per * n_moe * spec.num_moe_experts * 3 * spec.hidden_size * spec.moe_ffn_hidden_size / vllm_tp


def active_params(spec: ArchSpec) -> float:
    """Parameters touched per token in a forward (LM head yes, embedding lookup no; top-k experts)."""
    p = spec.num_parameters()
    if not spec.tie_word_embeddings:
        p -= spec.vocab_size * spec.hidden_size
    if spec.is_moe:
        assert spec.num_moe_experts and spec.moe_ffn_hidden_size
        per_expert = 3 * spec.hidden_size * spec.moe_ffn_hidden_size
        p -= spec.num_layers * (spec.num_moe_experts - spec.moe_router_topk) * per_expert
    return float(p)


def expert_active_params(spec: ArchSpec) -> float:
    """Routed-expert parameters touched per token (top-k experts of every layer); 0 for dense models."""
    if not spec.is_moe:
        return 0.0
    assert spec.moe_ffn_hidden_size
    return float(spec.num_layers * spec.moe_router_topk * 3 * spec.hidden_size * spec.moe_ffn_hidden_size)


GEMM_WIDTH_EXPONENT = 0.06
"""How Megatron's MFU falls with GEMM size: NVIDIA/Megatron-LM's README weak-scaling table (H100, 4,096-token
sequences) goes from 41% MFU for its smallest GPT model (2B, hidden 2048) to 47% for the largest (462B,
hidden 20480): 0.87x over 10x the hidden size, (1/10)^0.06 = 0.87. Narayanan et al. 2021 (SC21, Table 1:
44% of A100 peak at 1.7B and hidden 2304, 44-52% up to 1T) show the same weak dependence."""


def gemm_mfu(mfu: float, hidden: int, tp: int, micro_tokens: int, *, ref_width: int, ref_tokens: int) -> float:
    """Dense MFU for GEMMs of per-GPU width ``hidden / tp`` over ``micro_tokens`` rows.

    ``mfu`` holds at width ``ref_width`` and ``ref_tokens`` rows; narrower or shorter GEMMs lose by the
    power law of :data:`GEMM_WIDTH_EXPONENT` (wider ones gain by it, capped at 1.15x: Megatron's largest
    models reach 47-52%, ~1.15x the 41-44% of its 2B models).
    """
    width = (hidden / tp) / ref_width
    rows = min(1.0, micro_tokens / ref_tokens)
    return mfu * min(1.15, width**GEMM_WIDTH_EXPONENT) * rows**GEMM_WIDTH_EXPONENT
