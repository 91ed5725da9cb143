"""The training pool's rollout side in the disaggregated placement: batches arrive from the rollout pool.

It presents the interface of :class:`~megatron_maspo.train.rollouts.side.RolloutSide`, so the loop does not
fork:

    batch(s, v)        the batch for step s, received from the lead engine (waits only if it is late)
    metrics(...)       first receives batch s + k, the one the engines made while step s trained (the
                       colocated loop generates it at step s, so its grader totals and phase times are
                       this step's); then the same reward / fleet / staleness figures as colocated, plus
                       rollout/engine_busy_s, time/wait_rollout and, with in-flight updates, the spread
                       of versions inside responses
    state()            prompt order, grader totals and the batches received ahead (checkpoint)
    weight_sink        the sync's destination on each sender rank: a WeightSender over its bridges
    close(clean)       on a clean stop, receive the batch the schedule let the engines start, then stop them

Every trainer rank receives every batch (one broadcast over the ``batches`` bridge), as every rank of a
colocated fleet gathers every group.
"""

from __future__ import annotations

import time

from megatron_maspo.errors import ConfigError
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.pool_sync import WeightSender
from megatron_maspo.rollout.pools import PoolLayout
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import TrainConfig
from megatron_maspo.train.rollouts.groups import PromptGroup, RolloutBatch
from megatron_maspo.train.rollouts.shard import EngineRound
from megatron_maspo.train.rollouts.side import step_metrics
from megatron_maspo.train.rollouts.staleness import StalenessQueue


class RemoteRolloutSide:
    """Batches from the rollout pool, in step order, bounded by ``rollout.max_staleness``.

    Args:
        pools: the job's layout.
        batches: the ``batches`` bridge (every trainer rank; the lead engine is member 0).
        sender: this rank's :class:`WeightSender` on a weight sender (rank 0; with ``rollout.sync_senders=
            stages`` also each stage's first rank and each EP rank), None on the other trainer ranks.
        rollout, train: ``rollout.*`` and ``train.*``.
        state: the checkpoint's data state (``{}`` fresh).
        version_offset: steps done before a resume.
    """

    shard = None  # no engine in the training pool

    def __init__(self, pools: PoolLayout, *, batches, sender: WeightSender | None, rollout: RolloutConfig,
                 train: TrainConfig, state: dict, version_offset: int) -> None:
        self.pools, self.bridge, self.sender = pools, batches, sender
        self.rollout, self.train, self.version_offset = rollout, train, version_offset
        self.fleet = pools.fleet
        self.k = rollout.max_staleness
        self.reward_totals: dict[str, int] = {k: int(v) for k, v in state.get("reward_totals", {}).items()}
        self.order_state = {"epoch": state.get("epoch", 0), "cursor": state.get("cursor", 0)}
        self.queue = StalenessQueue(self.k)
        self.queue.load_state(state.get("rollout_queue"), version_offset)
        if self.k == 0 and len(self.queue):
            raise ConfigError("the checkpoint holds rollout batches generated ahead (rollout.max_staleness "
                              "> 0): resume it with the same rollout.max_staleness")
        self.received = max(self.queue.pending, default=version_offset - 1)  # last target we hold
        self.steps_done = version_offset
        self._uncounted: list[dict] = []  # received messages whose rounds no step has reported yet
        self._seen: list[PromptGroup] = []
        self._dropped = 0
        self._wait = 0.0
        self._starts: dict[int, float] = {}  # sync index -> wall time of its common start (sync_started)
        self._landed: dict[int, list[dict]] = {}  # sync index -> the owners' applied entries so far
        # where the rollout pool starts: the first batch not held, and the prompt order after the last held
        self.bridge.broadcast_object({"first_target": self.received + 1, "version_offset": version_offset,
                                      **self.order_state}, 1)

    @property
    def weight_sink(self) -> WeightSender | None:
        """This rank's sender to the rollout pool (the sync's sink), None on ranks that send nothing."""
        return self.sender

    def describe(self, num_prompts: int) -> str:
        return self.pools.describe(num_prompts)

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        return self.pools.sender_ranks

    def sync_started(self) -> None:
        """The common start of a sync (the loop calls it right after the sync's barrier): the start of
        ``sync/transfer_s``, which the engines end (:func:`engine_transfer`). Read on the wall clock, as the
        engines read their end; sync indices count this process's syncs, as the receivers count theirs."""
        if self.sender is not None:
            self._starts[self.sender.policy_version + 1] = time.time()

    def _receive_through(self, target: int) -> None:
        """Receive batches until ``target`` is held (each one in order, from the lead engine)."""
        while self.received < target:
            t0 = time.perf_counter()
            msg = self.bridge.broadcast_object(None, 0)
            self._wait += time.perf_counter() - t0
            batch: RolloutBatch = msg["batch"]
            if batch.step != self.received + 1:
                raise RuntimeError(f"rollout pool sent the batch for step {batch.step}, expected "
                                   f"{self.received + 1}")
            self.received = batch.step
            self.queue.push(batch)
            self.order_state = msg["order"]
            self._uncounted.append(msg)

    # ------------------------------------------------------------------ one step
    def batch(self, step: int, version: int) -> RolloutBatch:
        """The batch for 0-based ``step`` (made by the weights of step ``max(0, step - k)``)."""
        self._wait = 0.0
        self._receive_through(step)
        batch = self.queue.pop(step)
        self._seen, self._dropped = batch.seen, batch.dropped
        self.steps_done = step + 1
        return batch

    def metrics(self, samples: list[Sample], trained_version: int) -> dict[str, float]:
        """This step's figures (see the module docstring); receives batch ``step + k`` first."""
        self._receive_through(self.steps_done - 1 + self.k)
        msgs, self._uncounted = self._uncounted, []
        rounds: list[EngineRound] = [r for m in msgs for r in m["rounds"]]
        out = step_metrics(self._seen, rounds, dropped=self._dropped, fleet=self.fleet, rollout=self.rollout,
                           totals=self.reward_totals,
                           staleness=(samples, trained_version) if self.k > 0 else None)
        out["rollout/engine_busy_s"] = sum(m["busy_s"] for m in msgs)
        applied = [a for m in msgs for a in m.get("applied", [])]
        out.update(applied_metrics(applied))
        out.update(engine_transfer(self._starts, self._landed, applied, owners=len(self.pools.owner_ranks)))
        out.update(engine_fault_metrics([m.get("engine_faults", []) for m in msgs]))
        out["time/wait_rollout"] = self._wait
        if self.rollout.in_flight_updates:
            out.update(version_spread(self._seen))
        return out

    def state(self) -> dict:
        """Prompt order after the last received batch, grader totals, the batches held ahead."""
        return {"reward_totals": dict(self.reward_totals), **self.order_state,
                "rollout_queue": self.queue.state(self.version_offset)}

    def close(self, clean: bool = True) -> None:
        """Stop the rollout pool. On a clean stop first receive the one batch the engines may be making
        (they hold the weights for step ``steps_done + k``), so no engine is left blocked in a send."""
        if not clean:
            return
        if self.steps_done < self.train.steps:
            self._receive_through(self.steps_done + self.k)  # made with our last weights: discarded
        if self.sender is not None:
            self.sender.stop()


def engine_fault_metrics(per_batch: list[list[dict[str, float]]]) -> dict[str, float]:
    """Supervised engines (``rollout.supervise_engines``): the owners' fault figures of the batches received
    this step (``EngineSupervisor.metrics`` of each owner, per batch, oldest first). Job totals
    (``rollout/engine_restarts``, ``rollout/prompts_reissued``) and ``rollout/engines_live`` come from
    the latest batch, summed over owners; failures and time lost are summed over every batch, the
    detection delay is their maximum; ``rollout/engines_joined`` / ``_drained`` are job totals like the
    restarts, ``rollout/engine_prompts/e<id>`` (each engine's share) sums over the batches. Empty without
    supervision."""
    latest = next((b for b in reversed(per_batch) if b), None)
    if latest is None:
        return {}
    every = [f for b in per_batch for f in b]
    out = {k: sum(f.get(k, 0.0) for f in latest)
           for k in ("rollout/engine_restarts", "rollout/prompts_reissued", "rollout/engines_live",
                     "rollout/engines_joined", "rollout/engines_drained")}
    for f in every:  # each engine's share of the prompts, over the batches of the step
        for k, v in f.items():
            if k.startswith("rollout/engine_prompts/"):
                out[k] = out.get(k, 0.0) + v
    out["rollout/engine_failures"] = sum(f["rollout/engine_failures"] for f in every)
    out["rollout/engine_time_lost_s"] = sum(f["rollout/engine_time_lost_s"] for f in every)
    out["rollout/engine_detect_s_max"] = max(f["rollout/engine_detect_s_max"] for f in every)
    return out


def applied_metrics(applied: list[dict]) -> dict[str, float]:
    """The syncs the engines applied while making this step's batches (``WeightReceiver.pop_applied``
    of every owner): ``sync/engine_pause_s`` (the engine loop's token-free time in activating a staged
    sync: copy-in or relay to the workers, plus digest verification; the longest over engines and syncs),
    ``sync/verify_s`` (the longest digest verification) and ``sync/verify_full_s`` (the last full digest's
    cost, the longest over engines). Zeros when no sync landed."""
    return {"sync/engine_pause_s": max((a["engine_pause_s"] for a in applied), default=0.0),
            "sync/verify_s": max((a["verify_s"] for a in applied), default=0.0),
            "sync/verify_full_s": max((a["verify_full_s"] or 0.0 for a in applied), default=0.0)}


def engine_transfer(starts: dict[int, float], landed: dict[int, list[dict]], applied: list[dict], *,
                    owners: int) -> dict[str, float]:
    """``sync/transfer_s`` of a disaggregated job, measured where the sync ends: from its common start on
    the training pool to the last byte staged on the slowest engine owner (``staged_at`` of
    ``WeightReceiver.pop_applied``), and ``sync/engine_pause_share``, the longest engine pause of that
    sync over it.

    The owners' entries of one sync reach the trainer with different batches (each owner applies it when
    its engine next needs it), so ``applied`` is added to ``landed`` (sync index -> entries) and a sync is
    reported once every owner's entry is in; the latest such sync gives the figures, and the syncs reported
    leave both dicts. Empty when no sync has completed since the last call (or this rank started none:
    ``starts`` is filled on the lead sender, the rank that logs).

    Both ends are wall-clock readings (``time.time()``) on different processes: exact on one host, and
    within the clock sync of the nodes (NTP or PTP, typically well under a millisecond) on a cluster.
    """
    for a in applied:
        if "sync" in a:
            landed.setdefault(a["sync"], []).append(a)
    done = sorted(n for n, entries in landed.items() if len(entries) >= owners and n in starts)
    if not done:
        return {}
    n = done[-1]
    entries, start = landed[n], starts[n]
    for m in [m for m in landed if m <= n]:
        landed.pop(m)
    for m in [m for m in starts if m <= n]:
        starts.pop(m)
    transfer = max(a["staged_at"] for a in entries) - start
    pause = max(a["engine_pause_s"] for a in entries)
    return {"sync/transfer_s": transfer, "sync/engine_pause_share": pause / max(transfer, 1e-9)}


def version_spread(groups: list[PromptGroup]) -> dict[str, float]:
    """In-flight updates: ``rollout/version_spread_max`` (newest minus oldest token version in one
    response) and ``rollout/responses_spanning_versions`` (fraction of responses with tokens of two or
    more versions)."""
    spans = []
    for g in groups:
        for c in g.completions_G:
            tv = c.token_versions or [c.policy_version]
            spans.append(max(tv) - min(tv))
    n = max(len(spans), 1)
    return {"rollout/version_spread_max": float(max(spans, default=0)),
            "rollout/responses_spanning_versions": sum(s > 0 for s in spans) / n}
