"""Final-answer extraction from a model response, before any parsing (pure string code).

Rules, in order (``RewardConfig.fallback`` decides how far down the list we go):

1. ``boxed``: the content of the **last** ``\\boxed{...}`` or ``\\fbox{...}`` (braces matched, so
   ``\\boxed{\\frac{1}{2}}`` yields ``\\frac{1}{2}``); ``\\boxed 5`` (no braces) yields ``5``.
2. ``answer_line``: the text after the last ``Answer:`` (case-insensitive; the DAPO-Math-17k prompt asks
   for ``Answer: $Answer`` on the last line), up to the end of that line, stripped of ``$`` and a final ``.``.
3. ``tail``: the last ``max_chars`` characters of the response, for math-verify's own un-anchored search
   (e.g. a bare final number).

Caps: an extracted span longer than ``max_chars`` counts as no answer (a real final answer is short, and
truncating one would grade a different expression); scanning is linear in the response length with no
regex backtracking, so 100k-character responses are cheap.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# Anchored at a line start and bounded to one line: no catastrophic backtracking on long inputs.
_ANSWER_LINE = re.compile(r"answer\s*[:：]", re.IGNORECASE)


def last_boxed(text: str, max_chars: int) -> str | None:
    """Return the content of the last ``\\boxed{}``/``\\fbox{}`` in ``text``, or None.

    Args:
        text: the model response.
        max_chars: longest accepted content; longer (or unbalanced) boxes return None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_len = len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")
    i = start + cmd_len
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # "\boxed 5": TeX takes one token; we take up to the next space or "$".
        j = i
        while j < n and text[j] not in " $\n":
            j += 1
        span = text[i:j]
        return span if 0 < len(span) <= max_chars else None
    depth = 0
    for j in range(i, min(n, i + max_chars + 2)):
        ch = text[j]
        if ch == "{" and text[j - 1] != "\\":
            depth += 1
        elif ch == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                span = text[i + 1 : j].strip()
                return span or None
    return None  # unbalanced, or longer than max_chars


def answer_line(text: str, max_chars: int) -> str | None:
    """Return the answer after the last ``Answer:`` marker (rest of that line), or None."""
    # Only the tail can hold the last marker's line; bounds the regex scan on huge responses.
    tail = text[-(4 * max_chars) :]
    last = None
    for m in _ANSWER_LINE.finditer(tail):
        last = m
    if last is None:
        return None
    line = tail[last.end() :].split("\n", 1)[0].strip()
    line = line.strip("$ ").rstrip(".").strip("$ ")
    if not line or len(line) > max_chars:
        return None
    return line


def extract_final_answer(text: str, *, policy: str, max_chars: int) -> tuple[str, str] | None:
    """Extract the final answer of ``text`` under a fallback policy.

    Args:
        text: the decoded model response (any length).
        policy: ``"boxed"``, ``"boxed_or_answer_line"`` or ``"any"`` (see module docstring).
        max_chars: cap on the returned span.

    Returns:
        ``(span, kind)`` with kind in ``{"boxed", "answer_line", "tail"}``, or None when no answer.

    Raises:
        ValueError: unknown ``policy``.
    """
    if policy not in ("boxed", "boxed_or_answer_line", "any"):
        raise ValueError(f"policy must be 'boxed', 'boxed_or_answer_line' or 'any', got {policy!r}")
    boxed = last_boxed(text, max_chars)
    if boxed is not None:
        return boxed, "boxed"
    if policy == "boxed":
        return None
    line = answer_line(text, max_chars)
    if line is not None:
        return line, "answer_line"
    if policy == "boxed_or_answer_line":
        return None
    tail = text[-max_chars:].strip()
    return (tail, "tail") if tail else None
