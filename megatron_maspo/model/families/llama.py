"""Llama 3.x (and SmolLM2, a Llama-architecture model): Llama-style, optional ``attention_bias``,
llama3 rope scaling with the low/high/original values megatron-core hard-codes.

Presets: each model's HF ``config.json``. Llama-3-70B (not 3.1): 8k context, no rope scaling.
"""

from __future__ import annotations

from megatron_maspo.model.families import llama_style
from megatron_maspo.model.families.declaration import ModelFamily
from megatron_maspo.model.families.names import FamilyTable

_LLAMA3_IDS = {"bos_token_id": 128000, "eos_token_id": 128001}
_LLAMA3_70B = dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                   num_query_groups=8, kv_channels=128, vocab_size=128256, max_position_embeddings=8192,
                   rotary_base=500000.0, layernorm_epsilon=1e-5, tie_word_embeddings=False, extra=_LLAMA3_IDS)

FAMILY = ModelFamily(
    name="llama",
    display_name="Llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    names=FamilyTable("llama", llama_style.PRE, llama_style.ATTENTION + llama_style.DENSE_MLP,
                      llama_style.POST),
    from_hf=llama_style.spec_fields,
    to_hf=llama_style.config_json,
    # Llama 3.x: llama3 rope scaling (megatron's hard-coded low/high/original values), untied.
    tiny=dict(llama_style.TINY_COMMON, tie_word_embeddings=False, max_position_embeddings=16384,
              rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                               "rope_theta": 500000.0}),
    presets={
        # meta-llama/Meta-Llama-3-70B (70.6 B, GQA 64/8, 8k context)
        "llama3-70b": _LLAMA3_70B,
        # meta-llama/Llama-3.1-8B(-Instruct) (8.0 B, GQA 32/8, 128k context with llama3 rope scaling)
        "llama3.1-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, kv_channels=128, vocab_size=128256,
                            max_position_embeddings=131072, rotary_base=500000.0, layernorm_epsilon=1e-5,
                            tie_word_embeddings=False, extra=_LLAMA3_IDS),
        # meta-llama/Llama-3.1-70B and Llama-3.3-70B: Llama-3-70B's shapes, 128k context
        "llama3.1-70b": dict(_LLAMA3_70B, max_position_embeddings=131072),
        "llama3.3-70b": dict(_LLAMA3_70B, max_position_embeddings=131072),
        # HuggingFaceTB/SmolLM2-135M (9 heads / 3 KV heads, tied embeddings)
        "smollm2-135m": dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                             num_query_groups=3, kv_channels=64, vocab_size=49152, max_position_embeddings=8192,
                             rotary_base=100000.0, layernorm_epsilon=1e-5, tie_word_embeddings=True,
                             extra={"bos_token_id": 0, "eos_token_id": 0}),
    },
)
