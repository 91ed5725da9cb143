"""Published Qwen3.5 sizes as ``ArchSpec`` fields: the text model of each checkpoint.

Every size shares the hybrid pattern (three Gated DeltaNet layers, then one gated full-attention
layer), partial rotary 0.25 with base 1e7, head dim 256 on the full-attention layers, key/value head
dim 128 and conv kernel 4 on the linear ones, and the 248,320-token vocabulary. Sources of the
shapes: transformers 5.19's ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` defaults (the 9B and the
35B-A3B text configs), THUDM/slime's Megatron argument files (27B, 35B-A3B, 397B-A17B) and the model
cards (122B-A10B: 48 layers, hidden 3072, 32 heads, 256 experts, 8 routed + 1 shared). The vision
tower and the MTP layer are not part of these counts (``tests/unit/model/test_qwen3_5_presets.py``
compares each with its published size). The 0.8B, 2B and 4B are not here yet: their ``config.json``
could not be read from this machine.
"""

from __future__ import annotations

from typing import Any


def _layers(n: int) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(n))


def _spec(layers: int, hidden: int, ffn: int, heads: int, groups: int, key_heads: int, value_heads: int,
          *, tied: bool = False, **moe: Any) -> dict[str, Any]:
    return dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                num_query_groups=groups, kv_channels=256, vocab_size=248320, max_position_embeddings=262144,
                rotary_base=10000000.0, rotary_percent=0.25, layernorm_epsilon=1e-6, qk_layernorm=True,
                tie_word_embeddings=tied, layer_types=_layers(layers), attention_output_gate=True,
                zero_centered_norm=True,
                linear_attention=dict(num_key_heads=key_heads, num_value_heads=value_heads, key_head_dim=128,
                                      value_head_dim=128, conv_kernel=4), **moe)


def _moe(experts: int, width: int, topk: int) -> dict[str, Any]:
    return dict(num_moe_experts=experts, moe_ffn_hidden_size=width, moe_router_topk=topk, moe_norm_topk_prob=True,
                moe_shared_expert_intermediate_size=width, moe_shared_expert_gate=True)


DENSE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": _spec(32, 4096, 12288, 16, 4, 16, 32),
    "qwen3.5-27b": _spec(64, 5120, 17408, 24, 4, 16, 48),
}
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": _spec(40, 2048, 512, 16, 2, 16, 32, **_moe(256, 512, 8)),
    "qwen3.5-122b-a10b": _spec(48, 3072, 1024, 32, 2, 16, 64, **_moe(256, 1024, 8)),
    "qwen3.5-397b-a17b": _spec(60, 4096, 1024, 32, 2, 16, 64, **_moe(512, 1024, 10)),
}
