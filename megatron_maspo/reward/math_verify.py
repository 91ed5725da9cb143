"""Grade one response with Hugging Face Math-Verify (the only module importing ``math_verify``).

Runs inside a grading worker's main thread, where math-verify's ``signal.alarm`` timeouts work
(cpu-notes.md §4); the pool's hard deadline covers what a signal cannot interrupt (long C-level
big-integer arithmetic such as ``9^{9^{9^9}}``).
"""

from __future__ import annotations

import functools
import logging
import math

from megatron_maspo.reward.base import GradeStatus
from megatron_maspo.reward.extract import extract_final_answer

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as e:  # pragma: no cover - math-verify is a core dependency
    raise ImportError("math-verify is required for the math reward: pip install math-verify") from e

logger = logging.getLogger(__name__)

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


class _GoldParseError(Exception):
    """The gold answer did not parse (possibly a timeout); never cached."""


@functools.lru_cache(maxsize=4096)
def _parse_gold_cached(gold: str, timeout: int) -> tuple:
    # GRPO groups share one gold answer: parse it once per worker. verl wraps the gold in \boxed{}.
    text = gold if "\\boxed" in gold else f"\\boxed{{{gold}}}"
    parsed = parse(text, extraction_config=_EXTRACTION, parsing_timeout=timeout)
    if not parsed:
        # Do not cache a failure: it may be a timeout on a loaded machine, not a bad gold answer.
        raise _GoldParseError
    return tuple(parsed)


def _parse_gold(gold: str, timeout: int) -> list:
    try:
        return list(_parse_gold_cached(gold, timeout))
    except _GoldParseError:
        return []


def grade_math(
    response: str, gold: str, policy: str, max_chars: int, timeout_s: float
) -> GradeStatus:
    """Grade ``response`` against ``gold`` by mathematical equivalence.

    Args:
        response: decoded model response (any length; only the extracted span is parsed).
        gold: ground-truth answer, plain (``"1/2"``) or LaTeX (``"\\frac{1}{2}"``).
        policy: ``RewardConfig.fallback``.
        max_chars: ``RewardConfig.max_chars``.
        timeout_s: per-item budget; the prediction parse and the verify each get half of it, rounded
            up to whole seconds (``signal.alarm``'s resolution). The pool's hard deadline bounds the total.

    Returns:
        ``CORRECT``, ``WRONG`` or ``NO_ANSWER`` (math-verify timeouts surface as unparsed/unverified).
    """
    timeout = max(1, math.ceil(timeout_s / 2))
    found = extract_final_answer(response, policy=policy, max_chars=max_chars)
    if found is None:
        return GradeStatus.NO_ANSWER
    span, kind = found
    gold_parsed = _parse_gold(gold, timeout)
    if not gold_parsed:
        logger.warning("ground truth %r does not parse; scoring the item as wrong", gold[:80])
        return GradeStatus.WRONG
    text = f"\\boxed{{{span}}}" if kind == "boxed" else span
    pred = parse(text, extraction_config=_EXTRACTION, parsing_timeout=timeout)
    if not pred:
        return GradeStatus.NO_ANSWER
    ok = verify(gold_parsed, pred, timeout_seconds=timeout)
    return GradeStatus.CORRECT if ok else GradeStatus.WRONG
