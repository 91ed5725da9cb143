"""Qwen3 (dense): Llama-style with q/k RMSNorm that HF Qwen3 always has, ``head_dim`` not hidden/heads.

Presets: each model's HF ``config.json``.
"""

from __future__ import annotations

from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import ModelFamily
from megatron_maspo.model.families.names import FamilyTable

FAMILY = ModelFamily(
    name="qwen3",
    display_name="Qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    names=FamilyTable("qwen3", llama_style.PRE, llama_style.ATTENTION + llama_style.DENSE_MLP,
                      llama_style.POST),
    from_hf=llama_style.spec_fields,
    to_hf=llama_style.config_json,
    qk_norm=True,
    # Qwen3: q/k RMSNorm, head_dim != hidden/heads, tied.
    tiny=dict(llama_style.TINY_COMMON, head_dim=32, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    presets={
        # Qwen/Qwen3-32B (32.8 B; 64 layers, GQA 64/8, head_dim 128, QK-norm, no QKV bias, untied head)
        "qwen3-32b": dict(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                          num_query_groups=8, kv_channels=128, vocab_size=151936, max_position_embeddings=40960,
                          rotary_base=1000000.0, layernorm_epsilon=1e-6, qk_layernorm=True,
                          tie_word_embeddings=False, extra={"bos_token_id": 151643, "eos_token_id": 151645}),
    },
)
