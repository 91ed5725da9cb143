"""Exact public architectures as :class:`ArchSpec` presets, for planning and cluster recipes.

A recipe names a preset in ``model.arch`` when the checkpoint's ``config.json`` is not readable from the
machine that plans or submits the job. The numbers are the ones in each model's Hugging Face
``config.json`` (cross-checked against public Megatron launch scripts); when a local ``config.json``
exists, ``arch_spec_from_hf`` is authoritative and the two should agree.

Notes on look-alikes:
    * DeepSeek-R1-Distill-Qwen-1.5B / -7B derive from Qwen2.5-Math (rope_theta 1e4, untied head),
      unlike Qwen2.5-1.5B (tied) and Qwen2.5-7B (rope_theta 1e6). Their tensor shapes match Qwen2.5.
    * DeepSeek-R1-Distill-Qwen-14B has Qwen2.5-14B's shapes (8 KV heads, rms eps 1e-5, rope_theta 1e6).
    * Llama-3-70B (not 3.1): 8k context, no rope scaling.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_maspo.model.spec import ArchSpec

_QWEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151643}


def _qwen2(**kw) -> ArchSpec:
    # Qwen2 family constants: QKV bias, RMSNorm, SwiGLU, head_dim = hidden / heads.
    kw.setdefault("layernorm_epsilon", 1e-6)
    kw.setdefault("extra", dict(_QWEN_IDS))
    return ArchSpec(family="qwen2", add_qkv_bias=True, kv_channels=kw["hidden_size"] // kw["num_attention_heads"],
                    **kw)


def r1_distill_qwen_1p5b() -> ArchSpec:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (1.78 B parameters, untied LM head)."""
    return _qwen2(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                  num_query_groups=2, vocab_size=151936, max_position_embeddings=131072,
                  rotary_base=10000.0, tie_word_embeddings=False)


def r1_distill_qwen_7b() -> ArchSpec:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (7.6 B)."""
    return _qwen2(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                  num_query_groups=4, vocab_size=152064, max_position_embeddings=131072,
                  rotary_base=10000.0, tie_word_embeddings=False)


def r1_distill_qwen_14b() -> ArchSpec:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-14B (14.8 B)."""
    return _qwen2(num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                  num_query_groups=8, vocab_size=152064, max_position_embeddings=131072,
                  rotary_base=1000000.0, layernorm_epsilon=1e-5, tie_word_embeddings=False)


def qwen25_1p5b() -> ArchSpec:
    """Qwen/Qwen2.5-1.5B (tied embeddings)."""
    return _qwen2(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                  num_query_groups=2, vocab_size=151936, max_position_embeddings=131072,
                  rotary_base=1000000.0, tie_word_embeddings=True)


def qwen25_7b() -> ArchSpec:
    """Qwen/Qwen2.5-7B (7.6 B)."""
    return _qwen2(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                  num_query_groups=4, vocab_size=152064, max_position_embeddings=131072,
                  rotary_base=1000000.0, tie_word_embeddings=False)


def qwen25_14b() -> ArchSpec:
    """Qwen/Qwen2.5-14B (14.8 B)."""
    return _qwen2(num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                  num_query_groups=8, vocab_size=152064, max_position_embeddings=131072,
                  rotary_base=1000000.0, layernorm_epsilon=1e-5, tie_word_embeddings=False)


def llama3_70b() -> ArchSpec:
    """meta-llama/Meta-Llama-3-70B (70.6 B, GQA 64/8, 8k context)."""
    return ArchSpec(family="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                    num_attention_heads=64, num_query_groups=8, kv_channels=128, vocab_size=128256,
                    max_position_embeddings=8192, rotary_base=500000.0, layernorm_epsilon=1e-5,
                    tie_word_embeddings=False, extra={"bos_token_id": 128000, "eos_token_id": 128001})


def llama31_8b() -> ArchSpec:
    """meta-llama/Llama-3.1-8B(-Instruct) (8.0 B, GQA 32/8, 128k context with llama3 rope scaling)."""
    return ArchSpec(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                    num_attention_heads=32, num_query_groups=8, kv_channels=128, vocab_size=128256,
                    max_position_embeddings=131072, rotary_base=500000.0, layernorm_epsilon=1e-5,
                    tie_word_embeddings=False, extra={"bos_token_id": 128000, "eos_token_id": 128001})


def llama31_70b() -> ArchSpec:
    """meta-llama/Llama-3.1-70B (also Llama-3.3-70B: same shapes; 128k context)."""
    spec = llama3_70b()
    spec.max_position_embeddings = 131072
    return spec


def qwen3_32b() -> ArchSpec:
    """Qwen/Qwen3-32B (32.8 B; 64 layers, GQA 64/8, head_dim 128, QK-norm, no QKV bias, untied head)."""
    return ArchSpec(family="qwen3", num_layers=64, hidden_size=5120, ffn_hidden_size=25600,
                    num_attention_heads=64, num_query_groups=8, kv_channels=128, vocab_size=151936,
                    max_position_embeddings=40960, rotary_base=1000000.0, layernorm_epsilon=1e-6,
                    qk_layernorm=True, tie_word_embeddings=False,
                    extra={"bos_token_id": 151643, "eos_token_id": 151645})


def qwen3_30b_a3b() -> ArchSpec:
    """Qwen/Qwen3-30B-A3B (30.5 B total, 3.3 B active; 128 experts, top-8, QK-norm, head_dim 128)."""
    return ArchSpec(family="qwen3_moe", num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                    num_attention_heads=32, num_query_groups=4, kv_channels=128, vocab_size=151936,
                    max_position_embeddings=40960, rotary_base=1000000.0, layernorm_epsilon=1e-6,
                    qk_layernorm=True, tie_word_embeddings=False, num_moe_experts=128,
                    moe_ffn_hidden_size=768, moe_router_topk=8, moe_norm_topk_prob=True,
                    extra={"bos_token_id": 151643, "eos_token_id": 151645})


def fine_grained_moe_16b() -> ArchSpec:
    """A DeepSeek-MoE-style fine-grained-expert layout (16.9 B total, 2.6 B active): 64 small routed
    experts (FFN 1408), top-6, plus 2 shared experts' worth of always-on FFN (2816), on a Qwen3-style
    attention block (GQA 16/16 heads of 128, QK-norm) instead of MLA, and no leading dense layer, so the
    local and TE Megatron specs build it. For planning the expert layout only: no HF family converts it
    (qwen3_moe has no shared experts)."""
    return ArchSpec(family="qwen3_moe", num_layers=28, hidden_size=2048, ffn_hidden_size=10944,
                    num_attention_heads=16, num_query_groups=16, kv_channels=128, vocab_size=102400,
                    max_position_embeddings=16384, rotary_base=10000.0, layernorm_epsilon=1e-6,
                    qk_layernorm=True, tie_word_embeddings=False, num_moe_experts=64,
                    moe_ffn_hidden_size=1408, moe_router_topk=6, moe_norm_topk_prob=False,
                    moe_shared_expert_intermediate_size=2816,
                    extra={"bos_token_id": 100000, "eos_token_id": 100001})


def smollm2_135m() -> ArchSpec:
    """HuggingFaceTB/SmolLM2-135M (Llama family, 9 heads / 3 KV heads, tied embeddings)."""
    return ArchSpec(family="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                    num_attention_heads=9, num_query_groups=3, kv_channels=64, vocab_size=49152,
                    max_position_embeddings=8192, rotary_base=100000.0, layernorm_epsilon=1e-5,
                    tie_word_embeddings=True, extra={"bos_token_id": 0, "eos_token_id": 0})


PRESETS: dict[str, Callable[[], ArchSpec]] = {
    "r1-distill-qwen-1.5b": r1_distill_qwen_1p5b,
    "r1-distill-qwen-7b": r1_distill_qwen_7b,
    "r1-distill-qwen-14b": r1_distill_qwen_14b,
    "qwen2.5-1.5b": qwen25_1p5b,
    "qwen2.5-7b": qwen25_7b,
    "qwen2.5-14b": qwen25_14b,
    "llama3-70b": llama3_70b,
    "llama3.1-8b": llama31_8b,
    "llama3.1-70b": llama31_70b,
    "llama3.3-70b": llama31_70b,
    "qwen3-32b": qwen3_32b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "smollm2-135m": smollm2_135m,
}

PLANNING_LAYOUTS: dict[str, Callable[[], ArchSpec]] = {
    "fine-grained-moe-16b": fine_grained_moe_16b,
}
"""Layouts that are no published checkpoint (no HF round trip): ``model.arch`` for ``maspo plan`` only."""


def get_preset(name: str) -> ArchSpec:
    """A fresh :class:`ArchSpec` for preset ``name`` (case-insensitive).

    Raises:
        ValueError: unknown name, listing the accepted ones.
    """
    key = name.lower()
    known = {**PRESETS, **PLANNING_LAYOUTS}
    if key not in known:
        raise ValueError(f"model.arch={name!r} is not a known preset; accepted: {sorted(known)}")
    return known[key]()
