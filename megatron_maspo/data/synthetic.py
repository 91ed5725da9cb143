"""Synthetic arithmetic problems generated in code: the CPU default and the test dataset.

Single-digit ``a+b`` (the default) is learnable by a ~100k-parameter model in a few hundred RL steps;
``max_operand``, ``num_operands`` and ``ops`` raise the difficulty. Answers are plain integers, so
math-verify grades them exactly. Deterministic: the same seed yields the same problems in the same order
on every platform (``random.Random`` is specified to be reproducible across versions for integers).
"""

from __future__ import annotations

import random

from megatron_maspo.data.example import Example

_INSTRUCTION = "Compute {expr}. Put the final answer in \\boxed{{}}."


def arithmetic_examples(
    *,
    num_examples: int,
    max_operand: int = 9,
    num_operands: int = 2,
    ops: tuple[str, ...] = ("+",),
    seed: int = 0,
) -> list[Example]:
    """Generate ``num_examples`` problems ``a op b [op c ...]`` with integer answers.

    Args:
        num_examples: problems to generate.
        max_operand: operands are uniform in ``0..max_operand``.
        num_operands: operands per expression (>= 2).
        ops: operators drawn uniformly, from ``("+", "-", "*")``.
        seed: generation seed.

    Returns:
        Examples with ``prompt="Compute 3+4. Put the final answer in \\boxed{}."``, ``answer="7"``,
        ``source="synthetic_arithmetic"``.

    Raises:
        ValueError: a bad argument (named in the message).
    """
    if num_examples < 1 or max_operand < 1 or num_operands < 2:
        raise ValueError(
            f"need num_examples>=1, max_operand>=1, num_operands>=2; got {num_examples}, {max_operand}, {num_operands}"
        )
    if not ops or any(op not in ("+", "-", "*") for op in ops):
        raise ValueError(f"ops must be a non-empty subset of ('+', '-', '*'), got {ops!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_examples):
        operands = [rng.randint(0, max_operand) for _ in range(num_operands)]
        expr = str(operands[0])
        for x in operands[1:]:
            expr += f"{rng.choice(ops)}{x}"
        # eval of a string built here from ints and + - * only; Python precedence = math precedence.
        answer = eval(expr, {"__builtins__": {}})  # noqa: S307
        out.append(
            Example(
                prompt=_INSTRUCTION.format(expr=expr),
                answer=str(answer),
                source="synthetic_arithmetic",
            )
        )
    return out
