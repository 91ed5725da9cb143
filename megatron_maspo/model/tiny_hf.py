"""Tiny random transformers models of every registered family, built offline (tests, CPU recipe).

Each family declares its tiny config (``model/families/<family>.py``: ``tiny``); the transformers
classes are its first ``model_types`` / ``architectures`` entries.

Every parameter is redrawn from a seeded generator (norm weights around 1, everything else
N(0, 0.05^2), biases included; persistent float buffers such as the router's correction bias
N(0, 0.1^2)), so a converter that swaps, drops or zero-fills any tensor changes
the logits visibly; transformers' own init leaves norms at exactly 1 and biases at 0, which would
hide such bugs.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.model.families.registry import LiveMapping, family_view, get_family

logger = logging.getLogger(__name__)

TINY_DEFAULTS: LiveMapping[dict[str, Any]] = family_view(lambda f: copy.deepcopy(dict(f.tiny)) if f.tiny else None)
"""family -> HF config fields of its tiny model (each family declaration's ``tiny``); a registry view."""


def make_tiny_hf_model(family: str, out_dir: str | Path | None = None, *, vocab_size: int = 301,
                       seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """Build a random tiny HF causal LM of ``family`` (fp32, eval mode), optionally saving it.

    Args:
        family: a registered family with a tiny config (``TINY_DEFAULTS``: ``"llama"``, ``"qwen2"``,
            ``"qwen3"``, ``"qwen3_moe"``, ...).
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

    declared = get_family(family)
    model_cls = getattr(transformers, declared.architectures[0])
    config = transformers.AutoConfig.for_model(declared.model_types[0], **{**TINY_DEFAULTS[family],
                                                                           "vocab_size": vocab_size, **overrides})
    config.architectures = [model_cls.__name__]
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
        saved = set(model.state_dict())
        for name, b in model.named_buffers():  # persistent float state, e.g. the router's correction bias
            if name in saved and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        logger.info("saved tiny %s model to %s", family, out_dir)
    return model, config
