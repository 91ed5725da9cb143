"""The plain record every loader produces, and the counter of rows it had to skip."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Example:
    """One prompt with its verifiable answer."""

    prompt: str | list[dict[str, str]]
    """The question text, or a chat (``[{"role": ..., "content": ...}]``) as DAPO-Math-17k stores it."""
    answer: str
    """Ground-truth final answer (graded by the reward with math-verify)."""
    source: str = ""
    """Dataset / benchmark name (``data_source`` in DAPO, the file stem otherwise)."""
    prompt_ids: list[int] | None = None
    """Token ids of the rendered prompt, filled by ``data.templates.tokenize_examples``."""
    origin: str = ""
    """Where the row came from, in the form skip messages use (``file.jsonl:12`` = line 12; ``name[3]`` =
    row 3 of a json / parquet file or a function's rows), so a later skip names the same place."""


@dataclass
class SkipLog:
    """Counts of skipped rows by reason (``no_answer``, ``empty_prompt``, ``undecodable``, ...)."""

    counts: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, where: str) -> None:
        """Count one skipped row; the first of each reason is logged with its location."""
        if not self.counts[reason]:
            logger.warning(
                "skipping row (%s) at %s; further rows with this reason are only counted",
                reason,
                where,
            )
        self.counts[reason] += 1

    @property
    def total(self) -> int:
        """Number of skipped rows."""
        return sum(self.counts.values())
