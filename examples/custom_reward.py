"""A custom reward: replace math-verify with your own ``grade(response, answer) -> bool``.

Put this file's folder on ``PYTHONPATH`` (the working directory is not searched implicitly, so a
downloaded config cannot import a stray file: docs/security.md) and name the function in the config; the
trainer imports it by name and calls it inside its crash-proof grading pool, so a grader that hangs,
crashes or raises costs one item (scored ``reward.incorrect_reward``), never the run:

    cd examples
    PYTHONPATH=. maspo train --set reward.grader=custom_reward:last_number_matches \
        --set checkpoint.run_dir=runs/custom

``reward.correct_reward`` / ``reward.incorrect_reward`` (+1 / -1 by default) turn True / False into rewards;
only a ``bool`` counts (anything else is status ``invalid``, scored incorrect); ``reward.timeout_s``
bounds each call and ``reward.max_bad_fraction`` stops a run whose grader fails on most of a batch. The function must be defined at module level (the grading workers
import it by name) and should be pure: workers are recycled now and then.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(response: str, answer: str) -> bool:
    """True when the last number in ``response`` equals ``answer`` numerically (no ``\\boxed{}`` needed).

    More lenient than the default math-verify grading, which wants the answer in ``\\boxed{}`` or on an
    ``Answer:`` line: "the sum is 7" counts as correct for the answer "7".
    """
    numbers = _NUMBER.findall(response)
    if not numbers:
        return False
    try:
        return float(numbers[-1]) == float(answer)
    except ValueError:  # a non-numeric ground truth: compare the text
        return numbers[-1] == answer.strip()
