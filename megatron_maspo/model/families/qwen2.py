"""Qwen2 / Qwen2.5 (and the DeepSeek-R1-Distill-Qwen models built on them): Llama-style with q/k/v
biases that HF Qwen2 always has (no config key), rope without scaling.

Presets: the numbers are each model's HF ``config.json`` (cross-checked against public Megatron launch
scripts). Look-alikes: DeepSeek-R1-Distill-Qwen-1.5B / -7B derive from Qwen2.5-Math (rope_theta 1e4, untied
head), unlike Qwen2.5-1.5B (tied) and Qwen2.5-7B (rope_theta 1e6); their tensor shapes match Qwen2.5.
DeepSeek-R1-Distill-Qwen-14B has Qwen2.5-14B's shapes (8 KV heads, rms eps 1e-5, rope_theta 1e6).
"""

from __future__ import annotations

from typing import Any

from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import ModelFamily, SpecFields
from megatron_maspo.model.families.names import FamilyTable


def _preset(**kw: Any) -> SpecFields:
    # Qwen2 constants: QKV bias, RMSNorm eps 1e-6 unless given, head_dim = hidden / heads, Qwen token ids.
    kw.setdefault("layernorm_epsilon", 1e-6)
    kw.setdefault("extra", {"bos_token_id": 151643, "eos_token_id": 151643})
    return dict(add_qkv_bias=True, kv_channels=kw["hidden_size"] // kw["num_attention_heads"], **kw)


_SIZE_1P5B = dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                  num_query_groups=2, vocab_size=151936, max_position_embeddings=131072)
_SIZE_7B = dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                num_query_groups=4, vocab_size=152064, max_position_embeddings=131072)
_SIZE_14B = dict(num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                 num_query_groups=8, vocab_size=152064, max_position_embeddings=131072,
                 layernorm_epsilon=1e-5)

FAMILY = ModelFamily(
    name="qwen2",
    display_name="Qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    names=FamilyTable("qwen2", llama_style.PRE, llama_style.ATTENTION + llama_style.DENSE_MLP,
                      llama_style.POST),
    from_hf=llama_style.spec_fields,
    to_hf=llama_style.config_json,
    qkv_bias="always",
    # QKV bias (always on in HF Qwen2), tied embeddings.
    tiny=dict(llama_style.TINY_COMMON, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    presets={
        # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (1.78 B parameters, untied LM head)
        "r1-distill-qwen-1.5b": _preset(**_SIZE_1P5B, rotary_base=10000.0, tie_word_embeddings=False),
        # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (7.6 B)
        "r1-distill-qwen-7b": _preset(**_SIZE_7B, rotary_base=10000.0, tie_word_embeddings=False),
        # deepseek-ai/DeepSeek-R1-Distill-Qwen-14B (14.8 B)
        "r1-distill-qwen-14b": _preset(**_SIZE_14B, rotary_base=1000000.0, tie_word_embeddings=False),
        # Qwen/Qwen2.5-1.5B (tied embeddings)
        "qwen2.5-1.5b": _preset(**_SIZE_1P5B, rotary_base=1000000.0, tie_word_embeddings=True),
        # Qwen/Qwen2.5-7B (7.6 B)
        "qwen2.5-7b": _preset(**_SIZE_7B, rotary_base=1000000.0, tie_word_embeddings=False),
        # Qwen/Qwen2.5-14B (14.8 B)
        "qwen2.5-14b": _preset(**_SIZE_14B, rotary_base=1000000.0, tie_word_embeddings=False),
    },
)
