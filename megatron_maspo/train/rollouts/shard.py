"""One rollout round over the engine fleet: each engine generates and grades its shard, all ranks get all.

The engine-owning rank holds an :class:`EngineShard`; :func:`gather_shards` brings every shard to every rank.

    rank owning engine e:  groups_e = grade(engine_e.generate(prompts[shard_e]))     (in parallel)
    every rank:            groups   = concat(all_gather_object(groups_e))           (global prompt order)

Engine owners are in rank order and shards are contiguous in engine order, so concatenating the gathered
shards in group-rank order restores the step's prompt order. Sampling seeds depend on the global prompt
position (``SamplingParams.first_prompt``), so with the built-in engine the groups equal a one-engine run's.
Per-engine figures (prompts, tokens, seconds, policy version, grader totals) travel with the groups and
become the ``rollout/*`` metrics (:func:`fleet_metrics`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from megatron_maspo.parallel import comm
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.fleet import FleetLayout
from megatron_maspo.rollout.partial import generate_partial
from megatron_maspo.rollout.types import SamplingParams
from megatron_maspo.train.observe.meters import PhaseMeters
from megatron_maspo.train.rollouts.grading import grade_groups
from megatron_maspo.train.rollouts.groups import PromptGroup, overlong_penalty


@dataclass
class EngineRound:
    """What one engine did in one rollout round (picklable; gathered to every rank)."""

    engine: int
    prompts: int = 0
    tokens: int = 0
    """Generated tokens (all G responses of its prompts)."""
    seconds: float = 0.0
    """Generation wall time (grading excluded)."""
    grade_seconds: float = 0.0
    version: int = 0
    """Policy version the engine served (its sync count + the resume offset)."""
    reward_totals: dict[str, int] = field(default_factory=dict)
    """Grader outcome counts of this round (``reward/<status>_total`` increments)."""


class EngineShard:
    """This rank's engine and everything it needs to sample and grade its share of a round.

    Owns its state (engine, tokenizer, grader, prompt examples, the resume offset of its policy
    versions) and is used through :meth:`generate` and :meth:`close`; nothing reaches into it
    (the engine's sleep / wake around the update belong to the loop's ``Colocation``).

    Args:
        engine: the rollout engine (built-in or vLLM) this rank owns.
        engine_id: its index in the fleet; ``fleet`` gives its contiguous prompt shard.
        examples: the prompt dataset (``PromptExample``: ``prompt_ids``, ``answer``).
        grader: a ``RewardFn`` (``MathReward``); graded where generated.
        rollout: sampling settings (G, τ, top-p, max new tokens, sleep level).
        seed, overlong_buffer: ``train.seed`` (sampling seeds) and ``train.overlong_buffer`` (DAPO's
            soft overlong penalty).
        version_offset: steps done before a resume (a fresh engine counts its syncs from 0 again).
        meters: memory and progress per phase.
    """

    def __init__(self, engine: Any, *, engine_id: int, fleet: FleetLayout, tokenizer: Any,
                 examples: list, grader: Any, rollout: RolloutConfig, seed: int, overlong_buffer: int,
                 version_offset: int, meters: PhaseMeters) -> None:
        self.engine, self.engine_id, self.fleet = engine, engine_id, fleet
        engine.label = f"{engine.label} {engine_id}"  # verification errors name the engine of the fleet
        self.tokenizer, self.examples, self.grader = tokenizer, examples, grader
        self.rollout, self.seed, self.overlong_buffer = rollout, seed, overlong_buffer
        self.version_offset, self.meters = version_offset, meters
        self.between_steps = None
        """In-flight updates (rollout pool): called between decode steps (built-in engine) or between
        partial-rollout chunks (vLLM); it may load new weights there (``WeightReceiver.apply_staged``)."""

    @property
    def policy_version(self) -> int:
        """The policy version the engine serves (its sync count + the resume offset)."""
        return self.engine.policy_version + self.version_offset

    def generate(self, idx: list[int], step: int, round_: int) -> tuple[list[PromptGroup], EngineRound]:
        """Sample G responses for this engine's shard of ``idx`` and grade them.

        Args:
            idx: dataset indices of the whole round's prompts ``[P]`` (same list on every rank).
            step, round_: 0-based step and dynamic-sampling round (the sampling seed).
        """
        rc = self.rollout
        shard = self.fleet.shard(len(idx), self.engine_id)
        mine = [idx[i] for i in shard]
        info = EngineRound(engine=self.engine_id, prompts=len(mine), version=self.policy_version)
        if not mine:
            return [], info
        params = SamplingParams(n=rc.group_size, temperature=rc.temperature, top_p=rc.top_p,
                                max_tokens=rc.max_new_tokens, stop_token_ids=[self.tokenizer.eos_token_id],
                                seed=self.seed * 7919 + step * 101 + round_, first_prompt=shard.start)
        prompts = [self.examples[i].prompt_ids for i in mine]
        n_seq = len(prompts) * rc.group_size
        t0 = time.perf_counter()
        with self.meters.phase("generate", n_seq, "seq") as advance:
            if self.between_steps is None:
                comps = self.engine.generate(prompts, params, progress=advance)
            elif engines.traits(rc).takes_weights_between_steps:  # the built-in engine
                comps = self.engine.generate(prompts, params, progress=advance, on_step=self.between_steps)
            else:  # a blocking generate (vLLM): partial rollouts, the update lands between chunks
                comps = generate_partial(self.engine, prompts, params, chunk_tokens=rc.chunk_tokens,
                                         on_chunk=self.between_steps, progress=advance)
        info.seconds = time.perf_counter() - t0
        info.tokens = sum(len(c.token_ids) for cs in comps for c in cs)
        before = dict(getattr(self.grader, "totals", {}))
        t0 = time.perf_counter()
        with self.meters.phase("grade", n_seq, "resp") as advance:
            groups = grade_groups(self.grader, self.tokenizer, mine, prompts,
                                  [self.examples[i].answer for i in mine], comps, progress=advance)
        info.grade_seconds = time.perf_counter() - t0
        after = dict(getattr(self.grader, "totals", {}))
        info.reward_totals = {k: int(after[k] - before.get(k, 0)) for k in after}
        for g in groups:
            for j, c in enumerate(g.completions_G):
                g.rewards_G[j] += overlong_penalty(len(c.token_ids), rc.max_new_tokens, self.overlong_buffer)
        return groups, info

    def close(self) -> None:
        """Stop the grader's worker pool."""
        self.grader.close()


def make_shard(engine: Any, *, engine_id: int, fleet: FleetLayout, tokenizer: Any, examples: list,
               rollout: RolloutConfig, train: Any, reward: Any, version_offset: int, meters: PhaseMeters,
               ) -> EngineShard:
    """The one place an :class:`EngineShard` is built (the colocated side and the rollout pool): its grader
    from the ``reward`` section, sampling seed and overlong buffer from ``train``."""
    from megatron_maspo.reward.math_reward import MathReward

    return EngineShard(engine, engine_id=engine_id, fleet=fleet, tokenizer=tokenizer, examples=examples,
                       grader=MathReward(reward), rollout=rollout, seed=train.seed,
                       overlong_buffer=train.overlong_buffer, version_offset=version_offset, meters=meters)


def gather_shards(local: tuple[list[PromptGroup], EngineRound] | None, fleet: FleetLayout,
                  num_prompts: int) -> tuple[list[PromptGroup], list[EngineRound]]:
    """All engines' groups in the round's prompt order and their per-engine figures, on every rank.

    Args:
        local: this rank's ``(groups, EngineRound)``; None on ranks that own no engine.
        num_prompts: P of the round; the gathered groups must number exactly P.

    Raises:
        RuntimeError: the gathered groups do not add up to P (an engine dropped or repeated a prompt).
    """
    parts = comm.all_gather_object(local)
    groups: list[PromptGroup] = []
    rounds: list[EngineRound] = []
    for part in parts:
        if part is not None:
            groups += part[0]
            rounds.append(part[1])
    if len(groups) != num_prompts or len(rounds) != fleet.num_engines:
        raise RuntimeError(f"rollout fleet: gathered {len(groups)} groups from {len(rounds)} engines, "
                           f"expected {num_prompts} from {fleet.num_engines}")
    return groups, rounds


def fleet_metrics(rounds: list[EngineRound], num_engines: int) -> dict[str, float]:
    """``rollout/*`` fleet figures of one step (several rounds with dynamic sampling are summed per engine).

    Keys: ``rollout/engines``, ``rollout/prompts_per_engine_{min,max}``,
    ``rollout/gen_tokens_per_s_engine_{mean,min}`` (engines that generated something),
    ``rollout/engine_policy_version_{min,max}``.
    """
    per: dict[int, list[float]] = {e: [0.0, 0.0, 0.0] for e in range(num_engines)}  # prompts, tokens, s
    versions = []
    for r in rounds:
        acc = per[r.engine]
        acc[0] += r.prompts
        acc[1] += r.tokens
        acc[2] += r.seconds
        versions.append(r.version)
    prompts = [a[0] for a in per.values()]
    rates = [a[1] / a[2] for a in per.values() if a[1] and a[2] > 0]
    out = {"rollout/engines": float(num_engines),
           "rollout/prompts_per_engine_min": float(min(prompts)),
           "rollout/prompts_per_engine_max": float(max(prompts))}
    if rates:
        out["rollout/gen_tokens_per_s_engine_mean"] = sum(rates) / len(rates)
        out["rollout/gen_tokens_per_s_engine_min"] = min(rates)
    if versions:
        out["rollout/engine_policy_version_min"] = float(min(versions))
        out["rollout/engine_policy_version_max"] = float(max(versions))
    return out


def reward_totals(rounds: list[EngineRound]) -> dict[str, int]:
    """Grader outcome counts summed over the engines of the given rounds."""
    out: dict[str, int] = {}
    for r in rounds:
        for k, v in r.reward_totals.items():
            out[k] = out.get(k, 0) + v
    return out
