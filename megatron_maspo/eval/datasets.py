"""Evaluation prompt sets, built like the training prompts (template, system prompt, chat template).

Shared by ``maspo eval`` and evaluation during training, so both see the prompts training saw.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.example import Example
from megatron_maspo.errors import MissingPathError


def eval_datasets(data: DataConfig, tokenizer: Any, *, files: list[str] | tuple[str, ...] = (),
                  benchmarks: str | None = None, num_problems: int = 64
                  ) -> tuple[dict[str, list[Example]], dict[str, int]]:
    """``({benchmark: tokenized examples}, {benchmark: prompts dropped for length})``.

    Args:
        data: the run's data config: its ``prompt_template``, ``system_prompt``, chat template and
            ``max_prompt_tokens`` apply to every benchmark (the training prompt).
        files: benchmark files, named by their stem.
        benchmarks: a folder searched by :func:`eval.benchmarks.find_benchmarks`.
        num_problems: without files or folder, a fresh draw of the run's synthetic task (another seed).

    Raises:
        FileNotFoundError: a missing file or folder.
    """
    from megatron_maspo.data.dataset import build_prompt_dataset

    if not (files or benchmarks):
        redraw = dataclasses.replace(data, num_examples=num_problems, seed=data.seed + 10_007)
        examples, skips = build_prompt_dataset(redraw, tokenizer)
        return {"synthetic_redraw": examples}, {"synthetic_redraw": skips.counts.get("too_long", 0)}
    paths = {Path(f).stem: Path(f) for f in files}
    if benchmarks:
        from megatron_maspo.eval.benchmarks import find_benchmarks

        paths.update(find_benchmarks(benchmarks))
    out: dict[str, list[Example]] = {}
    dropped: dict[str, int] = {}
    for name, f in paths.items():
        if not f.exists():
            raise MissingPathError(f"benchmark file {f}: no such file")
        dc = DataConfig(source=str(f), format="eval", prompt_template=data.prompt_template,
                        apply_chat_template=data.apply_chat_template, system_prompt=data.system_prompt,
                        max_prompt_tokens=data.max_prompt_tokens)
        out[name], skips = build_prompt_dataset(dc, tokenizer)
        dropped[name] = skips.counts.get("too_long", 0)
    return out, dropped
