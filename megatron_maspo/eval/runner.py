"""Evaluate a policy: generate ``k`` samples per problem, grade them, report Avg@k and Pass@k.

Written against the engine protocol of ``megatron_maspo.rollout.types`` (``generate(prompts, params) ->
[P][n] Completion``) and the reward protocol of ``megatron_maspo.reward.base`` (``RewardFn``): any engine
(vLLM, the HF fallback, a scripted test double) and any grader plug in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_maspo.data.example import Example
from megatron_maspo.eval.metrics import default_ks, render_json, render_table, summarize, table_ks
from megatron_maspo.reward.base import RewardFn
from megatron_maspo.rollout.types import Engine, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EvalReport:
    """Result of :func:`evaluate`."""

    summary: dict[str, dict[str, float]]
    """``{benchmark | "average": {"avg@k", "pass@1", ..., "num_problems"}}`` (see ``metrics.summarize``)."""
    num_correct: dict[str, list[int]]
    """Benchmark -> ``[P]`` correct samples per problem, out of ``k``."""
    k: int
    """Samples per problem."""
    status_counts: dict[str, int] = field(default_factory=dict)
    """Grading outcomes over all samples (``correct``, ``wrong``, ``timeout``, ...)."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    """Engine finish reasons over all samples (``stop`` / ``length``): truncation shows up here."""
    seconds: float = 0.0
    """Wall time of the whole evaluation."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Benchmark -> problems not generated for (prompt over the length budget); scored as wrong
    unless ``evaluate(dropped_as_wrong=False)``, so the denominator stays the benchmark's size."""

    def table(self) -> str:
        """Markdown table in percent (Pass@k at powers of two; the JSON has every k)."""
        return render_table(self.summary, table_ks(self.k))

    def to_json(self) -> str:
        """The report as JSON (summary, counts, k, seconds)."""
        import json

        return json.dumps(
            {**dataclasses.asdict(self), "summary": json.loads(render_json(self.summary))},
            indent=2,
            sort_keys=True,
        )


def evaluate(
    engine: Engine,
    datasets: Mapping[str, Sequence[Example]],
    *,
    k: int,
    sampling: SamplingParams,
    grader: RewardFn,
    tokenizer: Any,
    pass_ks: Sequence[int] | None = None,
    dropped: Mapping[str, int] | None = None,
    dropped_as_wrong: bool = True,
) -> EvalReport:
    """Generate ``k`` completions per problem for every benchmark, grade them and aggregate.

    Args:
        engine: rollout engine; called once per benchmark with all its prompts.
        datasets: benchmark name -> examples with ``prompt_ids`` set (``data.tokenize_examples``).
        k: samples per problem (overrides ``sampling.n``); MASPO reports Avg@32 / Pass@32.
        sampling: temperature, top_p, max_tokens, stop ids and seed.
        grader: scores decoded completions against ``Example.answer``; ``RewardOutput.correct`` is used.
        tokenizer: decodes completion ids (``skip_special_tokens=True``).
        pass_ks: Pass@k budgets (default: every k in 1..k, MASPO's Pass@k curve).
        dropped: benchmark -> problems removed before generation (prompt over the length budget).
        dropped_as_wrong: score them as 0 of k correct (default), so every benchmark keeps its full
            denominator; False reports on the evaluated problems only. Either way they are counted.

    Returns:
        An :class:`EvalReport`; benchmarks with no examples are skipped with a warning.

    Raises:
        ValueError: ``k < 1``, an example without ``prompt_ids``, or an engine answer of the wrong shape.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    params = dataclasses.replace(sampling, n=k)
    t0 = time.perf_counter()
    num_correct: dict[str, list[int]] = {}
    statuses: dict[str, int] = {}
    finishes: dict[str, int] = {}
    for name, examples in datasets.items():
        if not examples:
            logger.warning("benchmark %s has no examples; skipped", name)
            continue
        missing = next((i for i, e in enumerate(examples) if e.prompt_ids is None), None)
        if missing is not None:
            raise ValueError(
                f"datasets[{name!r}][{missing}].prompt_ids is None; tokenize the examples first"
            )
        completions_P_G = engine.generate([list(e.prompt_ids) for e in examples], params)
        if len(completions_P_G) != len(examples) or any(len(g) != k for g in completions_P_G):
            raise ValueError(
                f"engine returned {[len(g) for g in completions_P_G]} completions for {len(examples)} "
                f"prompts of {name!r}; expected {k} each"
            )
        texts = [
            tokenizer.decode(c.token_ids, skip_special_tokens=True)
            for g in completions_P_G
            for c in g
        ]
        answers = [e.answer for e in examples for _ in range(k)]
        out = grader(texts, answers)
        correct = out.correct
        num_correct[name] = [sum(correct[p * k : (p + 1) * k]) for p in range(len(examples))]
        if dropped_as_wrong:
            num_correct[name] += [0] * int((dropped or {}).get(name, 0))
        for s in out.statuses:
            statuses[str(s)] = statuses.get(str(s), 0) + 1
        for g in completions_P_G:
            for c in g:
                finishes[c.finish_reason] = finishes.get(c.finish_reason, 0) + 1
        logger.info("eval %s: %d problems x %d samples graded", name, len(examples), k)
    lost = {n: int(c) for n, c in (dropped or {}).items() if c}
    for n, c in lost.items():
        logger.warning("eval %s: %d problem(s) dropped (prompt over the length budget), scored %s",
                       n, c, "wrong" if dropped_as_wrong else "as absent")
    summary = summarize(num_correct, k, pass_ks if pass_ks is not None else default_ks(k), lost)
    return EvalReport(
        dropped=lost,
        summary=summary,
        num_correct=num_correct,
        k=k,
        status_counts=statuses,
        finish_reasons=finishes,
        seconds=time.perf_counter() - t0,
    )
