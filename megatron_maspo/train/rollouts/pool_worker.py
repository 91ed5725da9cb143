"""The rollout pool's loop (disaggregated placement): generate ahead of the trainer, as far as the
staleness bound allows, and hand each graded batch over.

    for target t = first, first+1, ...:               (every rank of the rollout pool, in lockstep)
        wait until the engine holds weight version  needed(t) = max(0, t - k) + 1
                                                    (staged syncs applied one by one: WeightReceiver)
        batch_t = BatchMaker.make(t)                  each engine its shard of the prompts, graded here
        lead engine -> every trainer rank: batch_t, its rounds, engine busy time, prompt-order state

Versions count syncs exactly as in the colocated loop (the initial sync is version 1 at step 0), so
``needed(t)`` is the version the colocated loop with the same ``k`` generates batch ``t`` with, and with
in-flight updates off every batch equals that loop's. The trainer consumes batch ``s`` at step ``s`` and
syncs version ``s + 2`` after it; the engine, meanwhile, makes batch ``s + k + 1`` with version ``s + 2``
... in short generation of step ``s + k`` overlaps the update of step ``s``.

With ``rollout.in_flight_updates`` the built-in engine also applies a sync that lands mid-batch between two
decode steps; each token keeps the log-prob and version it was sampled with (``Completion.token_versions``).

The loop ends when the trainer says stop (after its last step, or after a signal's checkpoint): the
trainer first receives every batch the schedule lets the engines start, so no send is left hanging.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time

from megatron_maspo.parallel import comm
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.fleet import FleetLayout
from megatron_maspo.rollout.pool_sync import WeightReceiver
from megatron_maspo.train.config import TrainConfig
from megatron_maspo.train.process.faults import FaultInjector
from megatron_maspo.train.rollouts.prompt_order import PromptOrder
from megatron_maspo.train.rollouts.shard import EngineShard
from megatron_maspo.train.rollouts.side import BatchMaker

logger = logging.getLogger(__name__)


def ignore_stop_signals() -> None:
    """SIGTERM / SIGINT / SIGUSR1 in the rollout pool are logged and otherwise ignored: the launcher sends
    them to every rank, and the trainer (which checkpoints first) ends the pool with its stop message."""
    def note(signum, _frame) -> None:
        logger.warning("rollout pool: received %s; the trainer checkpoints and then stops this pool",
                       signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        with contextlib.suppress(ValueError):  # not the main thread (tests)
            signal.signal(sig, note)


def needed_version(target: int, max_staleness: int) -> int:
    """Weight version (syncs done, the initial one included) that makes the batch trained at ``target``."""
    return max(0, target - max_staleness) + 1


class RolloutWorker:
    """One rank of the rollout pool.

    Args:
        shard: this rank's engine shard (None on ranks that only host an engine's TP workers).
        fleet: the engines of the pool (pool ranks).
        receiver: this owner's :class:`WeightReceiver` (None without an engine).
        batches: the ``batches`` bridge on the lead engine's rank (None elsewhere in the pool).
        rollout, train: ``rollout.*`` (k, in-flight updates) and ``train.*`` (steps, prompts, seed).
        num_examples: size of the prompt dataset.
        faults: ``MASPO_FAULT`` on this rank (``kind=raise`` at step s: when the batch trained at step s
            is about to be made; the engine-death test).
    """

    def __init__(self, shard: EngineShard | None, fleet: FleetLayout, *, receiver: WeightReceiver | None,
                 batches, rollout: RolloutConfig, train: TrainConfig, num_examples: int,
                 faults: FaultInjector | None = None) -> None:
        self.shard, self.fleet, self.receiver, self.batches = shard, fleet, receiver, batches
        self.rollout, self.train, self.num_examples = rollout, train, num_examples
        self.faults = faults

    def _engine_version(self) -> int:
        return self.shard.policy_version if self.shard is not None else 0

    def run(self) -> int:
        """Serve batches until the trainer says stop; returns the number of batches made."""
        start = self.batches.broadcast_object(None, 1) if self.batches is not None else None
        start = comm.broadcast_object(start, src=0)  # the pool's default group: lead engine -> the pool
        order = PromptOrder(self.num_examples, self.train.seed, start["epoch"], start["cursor"])
        maker = BatchMaker(self.shard, self.fleet, order, self.train)
        if self.shard is not None:
            self.shard.version_offset = start["version_offset"]
            if self.rollout.in_flight_updates:
                self.shard.between_steps = lambda: self.receiver.apply_staged(self.shard.engine)
        k, made = self.rollout.max_staleness, 0
        last = self.train.steps + k - 1  # the schedule's last batch (the final checkpoint keeps k of them)
        for target in range(start["first_target"], last + 1):
            want = needed_version(target, k)
            alive = (self.receiver.wait_for(lambda v=want: self._engine_version() >= v, self.shard.engine,
                                            timeout_s=self.rollout.pool_timeout_s,
                                            what=f"weight version {want}")
                     if self.receiver is not None else True)
            if not all(comm.all_gather_object(alive)):  # any owner told to stop: the whole pool stops
                return made
            if self.faults is not None:
                self.faults.at_step(target + 1)  # steps numbered from 1, as logged
            t0 = time.perf_counter()
            batch, rounds = maker.make(target, self._engine_version())
            busy = time.perf_counter() - t0
            made += 1
            if self.batches is not None:
                self.batches.broadcast_object({"batch": batch, "rounds": rounds, "busy_s": busy,
                                               "order": order.state()}, 0)
        if self.receiver is not None:  # wait for the trainer's stop (its final syncs land in the slot)
            self.receiver.wait_for(lambda: False, self.shard.engine, timeout_s=self.rollout.pool_timeout_s)
        return made
