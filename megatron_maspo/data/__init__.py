"""Prompt data: loaders (DAPO-Math-17k, question/answer jsonl, benchmarks), synthetic arithmetic,
reasoning-gym (extra), templating, and the in-code byte-level tokenizer."""

from __future__ import annotations

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.dataset import build_prompt_dataset, load_examples, tokenize_examples
from megatron_maspo.data.example import Example, SkipLog

__all__ = [
    "DataConfig",
    "Example",
    "SkipLog",
    "build_prompt_dataset",
    "load_examples",
    "tokenize_examples",
]
