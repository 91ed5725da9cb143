"""The rollout side of the loop: one batch of graded prompt groups per step, and the engines around it.

The loop asks this object, and nothing else, for rollouts:

    batch   = rollouts.batch(step, version)    every engine samples + grades its shard; all ranks get all
    rollouts.metrics(samples, version)          rollout/*, reward/*_total, time/generate, time/grade
    rollouts.state()                            prompt order, grader totals, queued batches (checkpoint)

With ``rollout.max_staleness = k > 0`` batches are generated ahead into a
:class:`~megatron_maspo.train.rollouts.staleness.StalenessQueue`; with ``k = 0`` every batch is made now
by the current weights. The engine's sleep and wake around the update follow the loop's
:class:`~megatron_maspo.train.actor.offload.Colocation` (its phase order is data). A colocated :class:`~megatron_maspo.train.rollouts.shard.EngineShard` and (later)
a separate engine pool present the same interface, so the loop does not fork.
"""

from __future__ import annotations

from typing import Protocol

from megatron_maspo.errors import ConfigError
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.fleet import FleetLayout
from megatron_maspo.rollout.types import WeightSink
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import TrainConfig
from megatron_maspo.train.rollouts.groups import (
    PromptGroup,
    RolloutBatch,
    group_metrics,
    select_groups,
)
from megatron_maspo.train.rollouts.prompt_order import PromptOrder
from megatron_maspo.train.rollouts.shard import (
    EngineRound,
    EngineShard,
    fleet_metrics,
    gather_shards,
    reward_totals,
)
from megatron_maspo.train.rollouts.staleness import StalenessQueue, staleness_metrics


class RolloutSource(Protocol):
    """Where the loop's batches come from: :class:`RolloutSide` (engines on the training ranks) or
    ``remote.RemoteRolloutSide`` (the rollout pool of a disaggregated job). The loop sees only this."""

    shard: EngineShard | None
    """This rank's engine shard (held-out evaluation runs on rank 0's), None without one."""
    version_offset: int
    """Steps done before a resume (policy versions are offset by it)."""

    @property
    def weight_sink(self) -> WeightSink | None:
        """What this rank's weight sync loads into (``sync_weights``'s sink), None on non-senders."""
        ...

    def sync_started(self) -> None:
        """A sync's common start, on every rank (a disaggregated source times the transfer to its engines
        from it)."""
        ...

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        """Ranks that hand weights to a sink in a sync (``sync_weights``'s ``sender_rank``)."""
        ...

    def batch(self, step: int, version: int) -> RolloutBatch:
        """The groups that train 0-based ``step``."""
        ...

    def metrics(self, samples: list[Sample], trained_version: int) -> dict[str, float]:
        """This step's rollout figures (:func:`step_metrics` plus the source's own)."""
        ...

    def state(self) -> dict:
        """Resumable state (prompt order, grader totals, batches made ahead)."""
        ...

    def describe(self, num_prompts: int) -> str:
        """One line for the log."""
        ...

    def close(self, clean: bool = True) -> None:
        """Release the engines (a clean stop ends a rollout pool in order)."""
        ...


class RolloutSide:
    """Prompt order, this rank's engine shard (None on ranks without an engine), the staleness queue.

    Args:
        shard: this rank's engine shard, or None.
        fleet: the engine layout of the whole job (every rank joins each round's gather).
        num_examples: size of the prompt dataset (the order shuffles indices into it).
        rollout: ``rollout.*`` (group size and τ for metrics, ``max_staleness``).
        train: ``train.*`` (prompts per step, dynamic sampling rounds, mini-batches, seed).
        state: the checkpoint's data state on resume (``{}`` for a fresh run).
        version_offset: steps done before a resume (queued batches carry their own versions).

    Raises:
        ConfigError: the checkpoint holds batches generated ahead but ``max_staleness`` is 0.
    """

    def __init__(self, shard: EngineShard | None, fleet: FleetLayout, *, num_examples: int,
                 rollout: RolloutConfig, train: TrainConfig, state: dict, version_offset: int) -> None:
        self.shard, self.fleet, self.rollout, self.train = shard, fleet, rollout, train
        self.version_offset = version_offset
        self.order = PromptOrder(num_examples, train.seed, state.get("epoch", 0), state.get("cursor", 0))
        # Grader outcome counts since the run began (reward/<status>_total): carried by checkpoints.
        self.reward_totals: dict[str, int] = {k: int(v) for k, v in state.get("reward_totals", {}).items()}
        self.queue: StalenessQueue | None = None  # None = the synchronous loop
        if rollout.max_staleness > 0:
            self.queue = StalenessQueue(rollout.max_staleness)
            self.queue.load_state(state.get("rollout_queue"), version_offset)
        elif state.get("rollout_queue", {}).get("batches_json", "[]") != "[]":
            raise ConfigError("the checkpoint holds rollout batches generated ahead (rollout.max_staleness "
                              "> 0): resume it with the same rollout.max_staleness")
        self.maker = BatchMaker(shard, fleet, self.order, train)
        self._rounds: list[EngineRound] = []
        self._seen: list[PromptGroup] = []
        self._dropped = 0

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        """Ranks that hand weights to an engine in a sync (``sync_weights``'s ``sender_rank``)."""
        return self.fleet.engine_ranks

    @property
    def weight_sink(self) -> WeightSink | None:
        """What this rank's weight sync loads into: its engine, or None."""
        return self.shard.engine if self.shard is not None else None

    def sync_started(self) -> None:
        """Nothing to note: a colocated sync ends when its load returns (``sync/transfer_s`` is the senders')."""

    # ------------------------------------------------------------------ one step
    def batch(self, step: int, version: int) -> RolloutBatch:
        """The prompt groups that train 0-based ``step`` (collective: every rank joins each round)."""
        self._rounds = []
        if self.queue is None:
            batch = self._collect(step, version)
        else:  # generate ahead with the current weights (on a GPU this can overlap the update)
            for target in self.queue.due(step):
                self.queue.push(self._collect(target, version))
            batch = self.queue.pop(step)
        self._seen, self._dropped = batch.seen, batch.dropped
        return batch

    def _collect(self, step: int, version: int) -> RolloutBatch:
        batch, rounds = self.maker.make(step, version)
        self._rounds += rounds
        return batch

    def metrics(self, samples: list[Sample], trained_version: int) -> dict[str, float]:
        """This step's rollout figures: reward/group metrics over every generated group, phase times (the
        slowest engine's), fleet, staleness and grader totals."""
        return step_metrics(self._seen, self._rounds, dropped=self._dropped, fleet=self.fleet,
                            rollout=self.rollout, totals=self.reward_totals,
                            staleness=(samples, trained_version) if self.queue is not None else None)

    def state(self) -> dict:
        """Resumable state: prompt order, grader totals, and the queued batches (``k > 0``)."""
        out: dict = {"reward_totals": dict(self.reward_totals), **self.order.state()}
        if self.queue is not None:
            out["rollout_queue"] = self.queue.state(self.version_offset)
        return out

    def describe(self, num_prompts: int) -> str:
        return self.fleet.describe(num_prompts)

    def close(self, clean: bool = True) -> None:
        if self.shard is not None:
            self.shard.close()


class BatchMaker:
    """One step's batch from the fleet: dynamic-sampling rounds, then whole mini-batches.

    Collective over ``fleet``'s world (every rank joins each round's gather); used by the colocated side
    and, inside the rollout pool, by :class:`~megatron_maspo.train.rollouts.pool.RolloutWorker`.
    """

    def __init__(self, shard: EngineShard | None, fleet: FleetLayout, order: PromptOrder,
                 train: TrainConfig) -> None:
        self.shard, self.fleet, self.order, self.train = shard, fleet, order, train

    def make(self, step: int, version: int) -> tuple[RolloutBatch, list[EngineRound]]:
        """Groups for ``step`` made now with weight ``version``, and every engine's figures per round."""
        tc = self.train
        kept: list[PromptGroup] = []
        seen: list[PromptGroup] = []
        rounds: list[EngineRound] = []
        dropped = 0
        for r in range(tc.max_sampling_rounds if tc.dynamic_sampling else 1):
            need = tc.prompts_per_step - len(kept)
            idx = self.order.take(need)
            # every engine samples G responses for its shard of idx and grades them; all ranks get all
            local = self.shard.generate(idx, step, r) if self.shard is not None else None
            groups, got_rounds = gather_shards(local, self.fleet, len(idx))
            rounds += got_rounds
            seen += groups
            got, d = select_groups(groups, need, tc.dynamic_sampling)
            kept += got
            dropped += d
            if len(kept) >= tc.prompts_per_step:
                break
        if tc.dynamic_sampling and len(kept) < tc.mini_batches_per_step:
            kept = seen[: tc.prompts_per_step]  # too few informative groups: train on what we have
        # Round down so every mini-batch holds the same number of prompts.
        kept = kept[: max(tc.mini_batches_per_step,
                          len(kept) // tc.mini_batches_per_step * tc.mini_batches_per_step)]
        return RolloutBatch(step=step, version=version, kept=kept, seen=seen, dropped=dropped), rounds


def step_metrics(seen: list[PromptGroup], rounds: list[EngineRound], *, dropped: int, fleet: FleetLayout,
                 rollout: RolloutConfig, totals: dict[str, int],
                 staleness: tuple[list[Sample], int] | None) -> dict[str, float]:
    """One step's rollout figures, the same for every :class:`RolloutSource`: :func:`rollout_metrics`, the
    staleness figures when batches are made ahead (``staleness = (samples, trained_version)``), and the
    grader totals since the run began (``totals`` is updated in place with this step's rounds)."""
    out = rollout_metrics(seen, rounds, dropped=dropped, num_engines=fleet.num_engines,
                          max_new_tokens=rollout.max_new_tokens)
    if staleness is not None:
        out.update(staleness_metrics(*staleness, rollout.max_staleness))
    for k, v in reward_totals(rounds).items():  # over every engine's grader
        totals[k] = totals.get(k, 0) + v
    out.update({f"reward/{k}_total": float(v) for k, v in totals.items()})
    return out


def rollout_metrics(seen: list[PromptGroup], rounds: list[EngineRound], *, dropped: int,
                    num_engines: int, max_new_tokens: int) -> dict[str, float]:
    """Reward/group figures over the trained batch's groups, the generating rounds' phase times (the
    slowest engine's) and the fleet figures; grader totals are the caller's (they accumulate)."""
    out = group_metrics(seen, max_new_tokens=max_new_tokens)
    # A phase lasts as long as its slowest engine, summed over the step's rounds.
    out["time/generate"] = _per_round_max(rounds, "seconds")
    out["time/grade"] = _per_round_max(rounds, "grade_seconds")
    out["rollout/dropped_groups"] = float(dropped)
    out.update(fleet_metrics(rounds, num_engines))
    return out


def _per_round_max(rounds: list[EngineRound], attr: str) -> float:
    """Sum over rounds of the slowest engine's ``attr`` (engines of one round run in parallel)."""
    by_round: dict[int, float] = {}
    seen: dict[int, int] = {}
    for r in rounds:  # gathered in round order: each round contributes one entry per engine
        k = seen.get(r.engine, 0)
        seen[r.engine] = k + 1
        by_round[k] = max(by_round.get(k, 0.0), getattr(r, attr))
    return sum(by_round.values())
