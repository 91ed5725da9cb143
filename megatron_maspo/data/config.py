"""Configuration of the prompt data (training set or evaluation set)."""

from __future__ import annotations

from dataclasses import dataclass, field

FORMATS = ("auto", "dapo", "jsonl", "parquet", "eval")
OPS = ("+", "-", "*")


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from and how they become token ids."""

    source: str = "synthetic"
    """``"synthetic"`` (in-code arithmetic, the CPU default), ``"reasoning_gym:<name>"`` (needs the
    ``reasoning-gym`` extra), a path to a ``.parquet`` / ``.jsonl`` / ``.json`` file, or a user function
    ``"module:function"`` called with this config and returning rows in a file's schemas (an iterable of
    dicts; see ``examples/custom_dataset.py``)."""
    format: str = "auto"
    """Row schema of a file source: ``"dapo"`` (DAPO-Math-17k: ``prompt`` chat list or string,
    ``reward_model.ground_truth``, ``data_source``), ``"jsonl"`` (question/answer rows), ``"parquet"``
    (question/answer rows in parquet), ``"eval"`` (benchmark files: problem|question|prompt and
    answer|final_answer|solution), or ``"auto"`` (DAPO when a row has ``reward_model``, else field-name
    detection as for ``"eval"``)."""
    prompt_template: str = "{question}"
    """Template for string prompts; ``{question}`` is replaced by the problem text. Chat-list prompts
    (DAPO) are used as given."""
    system_prompt: str | None = None
    """Optional system message prepended to every chat (None = no system message)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (with the generation prompt) before encoding;
    False encodes the templated text directly."""
    num_examples: int = 256
    """Synthetic / reasoning-gym: number of problems generated."""
    max_operand: int = 9
    """Synthetic: operands are drawn from 0..max_operand (9 = single digits, the easiest setting)."""
    num_operands: int = 2
    """Synthetic: operands per expression (2 = ``a+b``)."""
    ops: tuple[str, ...] = ("+",)
    """Synthetic: operators to draw from, a subset of ``("+", "-", "*")``."""
    seed: int = 0
    """Synthetic / reasoning-gym generation seed (same seed ⇒ same problems, in the same order)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after templating) are skipped and counted, not truncated."""
    limit: int | None = None
    """Keep only the first ``limit`` valid examples of a file source (None = all)."""
    extra: dict = field(default_factory=dict)
    """Extra keyword arguments for ``reasoning_gym.create_dataset``."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError(
                "DataConfig.source must be 'synthetic', 'reasoning_gym:<name>' or a file path"
            )
        if self.format not in FORMATS:
            raise ValueError(f"DataConfig.format must be one of {FORMATS}, got {self.format!r}")
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"DataConfig.prompt_template must contain '{{question}}', got {self.prompt_template!r}"
            )
        if self.num_examples < 1:
            raise ValueError(f"DataConfig.num_examples must be >= 1, got {self.num_examples}")
        if self.max_operand < 1:
            raise ValueError(f"DataConfig.max_operand must be >= 1, got {self.max_operand}")
        if self.num_operands < 2:
            raise ValueError(f"DataConfig.num_operands must be >= 2, got {self.num_operands}")
        self.ops = tuple(self.ops)
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(
                f"DataConfig.ops must be a non-empty subset of {OPS}, got {self.ops!r}"
            )
        if self.max_prompt_tokens < 1:
            raise ValueError(
                f"DataConfig.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"DataConfig.limit must be >= 1 or None, got {self.limit}")
