"""Tiny random transformers models of every supported family, built offline (tests, CPU recipe).

Every parameter is redrawn from a seeded generator (norm weights around 1, everything else
N(0, 0.05^2), biases included), so a converter that swaps, drops or zero-fills any tensor changes
the logits visibly; transformers' own init leaves norms at exactly 1 and biases at 0, which would
hide such bugs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               rms_norm_eps=1e-6, attention_dropout=0.0)
TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    # Qwen2: QKV bias (always on in HF Qwen2), tied embeddings.
    "qwen2": dict(_COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 10000.0}),
    # Llama 3.x: llama3 rope scaling (megatron's hard-coded low/high/original values), untied.
    "llama": dict(_COMMON, tie_word_embeddings=False, max_position_embeddings=16384,
                  rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                   "rope_theta": 500000.0}),
    # Qwen3: q/k RMSNorm, head_dim != hidden/heads, tied.
    "qwen3": dict(_COMMON, head_dim=32, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3-MoE: 4 experts, top-2, normalised top-k probabilities, untied.
    "qwen3_moe": dict(_COMMON, head_dim=16, tie_word_embeddings=False, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def make_tiny_hf_model(family: str, out_dir: str | Path | None = None, *, vocab_size: int = 301,
                       seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """Build a random tiny HF causal LM of ``family`` (fp32, eval mode), optionally saving it.

    Args:
        family: ``"llama"``, ``"qwen2"``, ``"qwen3"`` or ``"qwen3_moe"``.
        out_dir: if given, ``save_pretrained`` (safetensors + config.json) there; no tokenizer.
        vocab_size: V; the default 301 is not divisible by 2, exercising vocab padding.
        seed: seed of the weight generator.
        **overrides: HF config fields replacing the tiny defaults (e.g. ``num_hidden_layers=4``).

    Returns:
        ``(model, config)``.
    """
    if family not in TINY_DEFAULTS:
        raise ValueError(f"family={family!r} is not supported; accepted: {sorted(TINY_DEFAULTS)}")
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[family])
    config = cfg_cls(**{**TINY_DEFAULTS[family], "vocab_size": vocab_size, **overrides})
    config.architectures = [model_cls.__name__]
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        logger.info("saved tiny %s model to %s", family, out_dir)
    return model, config
