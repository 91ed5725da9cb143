"""Turn a :class:`DataConfig` into tokenized prompts: load or generate, template, encode, filter."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.example import Example, SkipLog
from megatron_maspo.data.loaders import load_file, rows_to_examples
from megatron_maspo.data.synthetic import arithmetic_examples
from megatron_maspo.errors import InputError
from megatron_maspo.plugins import is_target, resolve

logger = logging.getLogger(__name__)


def load_examples(cfg: DataConfig, skips: SkipLog | None = None) -> list[Example]:
    """Load or generate the examples ``cfg.source`` names (untokenized)."""
    skips = skips if skips is not None else SkipLog()
    if cfg.source == "synthetic":
        return arithmetic_examples(
            num_examples=cfg.num_examples,
            max_operand=cfg.max_operand,
            num_operands=cfg.num_operands,
            ops=cfg.ops,
            seed=cfg.seed,
        )
    if cfg.source.startswith("reasoning_gym:"):
        from megatron_maspo.data.reasoning_gym import reasoning_gym_examples

        return reasoning_gym_examples(
            cfg.source.split(":", 1)[1],
            num_examples=cfg.num_examples,
            seed=cfg.seed,
            skips=skips,
            **cfg.extra,
        )
    if is_target(cfg.source) and not Path(cfg.source).exists():
        # a user function returning rows with the same schemas as a file (see examples/custom_dataset.py)
        rows = resolve(cfg.source, "data.source")(cfg)
        return rows_to_examples(iter(rows), schema="dapo" if cfg.format == "dapo" else "auto",
                                source=cfg.source.split(":")[0], skips=skips, limit=cfg.limit)
    return load_file(cfg.source, format=cfg.format, skips=skips, limit=cfg.limit)


def render_prompt(example: Example, tokenizer: Any, cfg: DataConfig) -> str:
    """The prompt text the policy sees: templated question, system prompt, chat template.

    Args:
        example: string prompts go through ``cfg.prompt_template``; chat lists are used as given.
        tokenizer: a ``transformers`` tokenizer (its ``chat_template`` is used when enabled).
        cfg: template, system prompt and chat-template switch.
    """
    if isinstance(example.prompt, str):
        messages = [
            {"role": "user", "content": cfg.prompt_template.replace("{question}", example.prompt)}
        ]
    else:
        messages = list(example.prompt)
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    if not cfg.apply_chat_template:
        return "\n\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def tokenize_examples(
    examples: list[Example], tokenizer: Any, cfg: DataConfig, skips: SkipLog | None = None
) -> list[Example]:
    """Fill ``prompt_ids`` for each example; drop (and count as ``too_long``) prompts over the cap.

    Returns:
        The kept examples, in order, each with ``prompt_ids: list[int]`` of length ``<= max_prompt_tokens``.
    """
    skips = skips if skips is not None else SkipLog()
    out = []
    for i, ex in enumerate(examples):
        # Special tokens come from the template text itself; no BOS/EOS added on top.
        ids = tokenizer.encode(render_prompt(ex, tokenizer, cfg), add_special_tokens=False)
        if len(ids) > cfg.max_prompt_tokens:
            skips.skip("too_long", ex.origin or f"{ex.source}[{i}]")  # where the loader found the row
            continue
        ex.prompt_ids = ids
        out.append(ex)
    return out


def build_prompt_dataset(cfg: DataConfig, tokenizer: Any) -> tuple[list[Example], SkipLog]:
    """Load/generate, template and tokenize; returns the examples and the skip counts."""
    skips = SkipLog()
    examples = tokenize_examples(load_examples(cfg, skips), tokenizer, cfg, skips)
    if not examples:
        raise InputError(f"data.source={cfg.source!r}: no usable row (skipped: {dict(skips.counts)})")
    logger.info("prompt dataset: %d examples, skipped %s", len(examples), dict(skips.counts))
    return examples, skips
