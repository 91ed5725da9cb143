"""Partial rollouts: in-flight weight updates for an engine whose ``generate`` is blocking (vLLM).

Such an engine cannot take weights between two decode steps, so a call is cut into chunks of at most
``chunk_tokens`` new tokens; between chunks new weights may land (``on_chunk``), and every unfinished
response continues under them with its prefix as the prompt:

    round 0:   prompts x n samples, max_tokens = chunk                 (weights v)
    on_chunk() ...                                                     (maybe v -> v+1)
    round r:   each unfinished row: prompt + its tokens so far, n = 1, max_tokens = min(chunk, left)
    ...        until every row stopped or reached ``params.max_tokens``

Each token keeps the log-prob the engine reported when it was sampled and the version of that chunk
(``Completion.token_versions``); the engine recomputes the prefix's KV cache under the new weights (vLLM
resets its prefix cache on every load), the behaviour of slime's partial rollouts. The built-in engine
does not need this: it takes weights between decode steps (``BuiltinEngine.generate(on_step=...)``).

Sampling seeds: round r seeds row k from ``(params.seed + r, k)`` so rounds draw distinct streams; a run
with in-flight updates is not bit-reproducible anyway (an update lands wherever the trainer is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron_maspo.rollout.types import Completion, SamplingParams


def generate_partial(engine: Any, prompts: list[list[int]], params: SamplingParams, *, chunk_tokens: int,
                     on_chunk: Callable[[], object],
                     progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
    """``engine.generate`` in chunks of ``chunk_tokens`` with ``on_chunk()`` between them; ``[P][n]``.

    Raises:
        ValueError: ``chunk_tokens < 1``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    versions: list[list[int]] = [[] for _ in rows]
    finish = ["length"] * len(rows)
    live = list(range(len(rows)))
    first = True
    round_ = 0
    while live:
        version = engine.policy_version
        # every live row has the same length: each round's survivors produced exactly ``step`` tokens
        step = min(chunk_tokens, params.max_tokens - len(tokens[live[0]]))
        if first:  # all samples of a prompt in one request (vLLM's n children)
            p = dataclasses.replace(params, max_tokens=step)
            outs = [c for cs in engine.generate(prompts, p) for c in cs]
            first = False
        else:
            p = dataclasses.replace(params, n=1, max_tokens=step, first_prompt=0,
                                    seed=None if params.seed is None else params.seed + round_)
            outs = [cs[0] for cs in engine.generate([prompts[rows[k][0]] + tokens[k] for k in live], p)]
        done = []
        for k, c in zip(live, outs):
            tokens[k] += c.token_ids
            logprobs[k] += c.logprobs
            versions[k] += [version] * len(c.token_ids)
            if c.finish_reason == "stop" or len(tokens[k]) >= params.max_tokens:
                finish[k] = c.finish_reason
                done.append(k)
        if progress is not None and done:
            progress(len(done))
        gone = set(done)
        live = [k for k in live if k not in gone]
        round_ += 1
        if live:
            on_chunk()
    result: list[list[Completion]] = [[] for _ in prompts]
    for k, (i, _) in enumerate(rows):
        result[i].append(Completion(token_ids=tokens[k], logprobs=logprobs[k], finish_reason=finish[k],
                                    policy_version=versions[k][0] if versions[k] else engine.policy_version,
                                    token_versions=versions[k]))
    return result
