"""The rollout pool (disaggregated placement): its process's main (:func:`run_rollout_pool`), its loop
(:class:`RolloutWorker`: generate ahead of the trainer, as far as the staleness bound allows, and hand each
graded batch over), the bridges between the pools and the training pool's side of them
(:func:`build_remote_side`).

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
from typing import Any, NamedTuple

from megatron_maspo.parallel import comm
from megatron_maspo.parallel.bridge import build_bridges
from megatron_maspo.parallel.device import default_device
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.rollout.fleet import FleetLayout, processes_per_node
from megatron_maspo.rollout.pool_sync import WeightReceiver, WeightSender
from megatron_maspo.rollout.pools import WeightLink
from megatron_maspo.train.config import TrainConfig
from megatron_maspo.train.observe.memory import PhaseMemory
from megatron_maspo.train.observe.meters import PhaseMeters
from megatron_maspo.train.process import faults
from megatron_maspo.train.process.distributed import JobPools
from megatron_maspo.train.process.faults import FaultInjector
from megatron_maspo.train.rollouts.prompt_order import PromptOrder
from megatron_maspo.train.rollouts.remote import RemoteRolloutSide
from megatron_maspo.train.rollouts.shard import EngineShard, make_shard
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
        elastic: a supervised owner's :class:`~megatron_maspo.rollout.supervision.elastic.ElasticOwner`
            (engines joining or leaving its fleet before a batch; None elsewhere).
    """

    def __init__(self, shard: EngineShard | None, fleet: FleetLayout, *, receiver: WeightReceiver | None,
                 batches, rollout: RolloutConfig, train: TrainConfig, num_examples: int,
                 faults: FaultInjector | None = None, elastic: Any = None) -> None:
        self.shard, self.fleet, self.receiver, self.batches = shard, fleet, receiver, batches
        self.rollout, self.train, self.num_examples = rollout, train, num_examples
        self.faults, self.elastic = faults, elastic

    def _engine_version(self) -> int:
        return self.shard.policy_version if self.shard is not None else 0

    def _fault_figures(self) -> list[dict[str, float]]:
        """Every supervised owner's fault figures since its last batch (``rollout.supervise_engines``; a
        collective of the pool then, so every rank calls it), else nothing."""
        if not self.rollout.supervise_engines:
            return []
        mine = self.shard.engine.metrics() if self.shard is not None else None
        return [f for f in comm.all_gather_object(mine) if f is not None]

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
            fault = self.faults.weight_fault(target + 1) if self.faults is not None else None
            if fault is not None and self.shard is not None:
                self.shard.engine.inject_fault(fault)  # the next sync this engine applies (failure tests)
            want = needed_version(target, k)
            alive = (self.receiver.wait_for(lambda v=want: self._engine_version() >= v, self.shard.engine,
                                            timeout_s=self.rollout.pool_timeout_s,
                                            what=f"weight version {want}")
                     if self.receiver is not None else True)
            if not all(comm.all_gather_object(alive)):  # any owner told to stop: the whole pool stops
                return made
            if self.faults is not None:
                self.faults.at_step(target + 1)  # steps numbered from 1, as logged
            if self.elastic is not None:  # engines join (holding this version) or leave before the batch
                self.elastic.at_boundary(target + 1)
            t0 = time.perf_counter()
            batch, rounds = maker.make(target, self._engine_version())
            busy = time.perf_counter() - t0
            # the digest checks of the weights that made this batch (run beside it) must pass before it
            # leaves: a WeightVerifyError ends this rank here, and the batch never reaches the trainer
            applied = self.receiver.pop_applied() if self.receiver is not None else []
            applied = [a for per in comm.all_gather_object(applied) for a in per]
            faults = self._fault_figures()
            made += 1
            if self.batches is not None:
                self.batches.broadcast_object({"batch": batch, "rounds": rounds, "busy_s": busy,
                                               "order": order.state(),
                                               "applied": applied, "engine_faults": faults}, 0)
        if self.receiver is not None:  # wait for the trainer's stop (its final syncs land in the slot)
            self.receiver.wait_for(lambda: False, self.shard.engine, timeout_s=self.rollout.pool_timeout_s)
            self.receiver.settle()  # the last deferred digest check, if any, still stops the job
        return made


# ---------------------------------------------------------------------------- the bridges and both ends
class LinkEnd(NamedTuple):
    """This rank's end of one weight link: the link (its senders and owners) and its two bridges."""

    link: WeightLink
    bridge: Any
    """Device payloads."""
    ctl: Any
    """Host headers, ends and stops."""


def bridges(rollout: RolloutConfig, pools: JobPools) -> tuple[list[LinkEnd], Any]:
    """This rank's weight links (``PoolLayout.weight_links``: device bucket bytes and host headers / end /
    stop, from one or more senders taking turns) and its ``batches`` bridge (host: pickled batches, None
    where it is not a member).

    Every group between the pools is made here, in one pass in ``PoolLayout.bridge_comms``' global order on
    every rank (a bridge's members block in its constructor until all have joined, for up to
    ``rollout.pool_timeout_s``): NCCL communicators created and connected now, split from one parent, at
    most ``rollout.weight_link_channels`` channels each (``parallel/bridge.py``). The rollout pool calls
    this before its engine takes the GPU.
    """
    lay, rank = pools.layout, pools.rank
    made = build_bridges(pools.store, lay.bridge_comms, rank, timeout_s=rollout.pool_timeout_s,
                         channels=rollout.weight_link_channels)
    links = [LinkEnd(link, made[link.name], made[link.ctl_name]) for link in lay.weight_links if rank in link.ranks]
    return links, made.get("batches")


def build_remote_side(pools: JobPools, *, rollout: RolloutConfig, train: TrainConfig, state: dict,
                      version_offset: int) -> RemoteRolloutSide:
    """The training pool's rollout source: batches from the rollout pool, weights to it (every sender)."""
    links, batches = bridges(rollout, pools)
    return RemoteRolloutSide(pools.layout, batches=batches, sender=sending_end(links, pools.rank), rollout=rollout,
                             train=train, state=state, version_offset=version_offset)


def sending_end(links: list[LinkEnd], rank: int) -> WeightSender | None:
    """A trainer rank's :class:`WeightSender` over its links (it sends on each; on a shared link in its
    turn), None without any; trainer rank 0 leads (its stop ends the rollout pool)."""
    if not links:
        return None
    first, *more = links
    return WeightSender(first.bridge, first.ctl, more=[(e.bridge, e.ctl) for e in more], lead=rank == 0,
                        turn=first.link.ranks.index(rank), turns=first.link.senders)


def receiving_end(links: list[LinkEnd]) -> tuple[list[tuple[Any, Any]], list[int]]:
    """An engine owner's ``(bridge, ctl)`` links for :class:`WeightReceiver` (the first positional, the rest
    ``more=``) in the plan's sender order (the link of trainer rank 0, the lead, first), and each link's
    senders (its ``turns=``)."""
    ends = sorted(links, key=lambda e: e.link.ranks[0])
    return [(e.bridge, e.ctl) for e in ends], [e.link.senders for e in ends]


def export_order(pools: JobPools, spec: Any, dtype: str) -> list[str] | None:
    """HF names in the export's global order when this owner receives from several senders (the
    ``stages`` transfer plan, as the trainer computes it), else None (one link: already in that order)."""
    lay = pools.layout
    if lay.sync_senders != "stages" or len(lay.sender_ranks) == 1:
        return None
    from megatron_maspo.rollout.transfer_plan import plan_pool_transfer

    return [s.name for s in plan_pool_transfer(spec, lay, dtype).sends]


def spanning_part(placements: Any, rank: int) -> Any:
    """This rank's part of an engine larger than a node (``rollout/engine_span.py``; None: it leads no
    node of one). Collective over the pool's default group when any engine spans nodes."""
    from megatron_maspo.parallel.launch import free_port
    from megatron_maspo.rollout import engine_span

    if not engine_span.any_spans(placements):
        return None
    return engine_span.rendezvous(placements, rank, all_gather=comm.all_gather_object, free_port=free_port)


def run_rollout_pool(pools: JobPools, *, rollout: RolloutConfig, model: Any, train: TrainConfig, reward: Any,
                     spec: Any, tokenizer: Any, examples: list, run_dir: Any = None) -> int:
    """One rank of the rollout pool: its engine (on owner ranks) and grader, then :class:`RolloutWorker`
    until the trainer says stop; returns the batches made. The sections are the run's ``rollout``,
    ``model`` (engine dtype, routing replay), ``train`` and ``reward``; ``run_dir`` holds the requests of
    engines joining or leaving (``maspo engines``; supervised owners only)."""
    lay = pools.layout
    fleet, pool_rank = lay.fleet, lay.pool_rank(pools.rank)
    engine_id = fleet.engine_of(pool_rank)
    links, batches = bridges(rollout, pools)
    shard = receiver = hosted = elastic = None
    placements = lay.placement(processes_per_node(lay.world))
    span = spanning_part(placements, pools.rank)
    if span is not None and not span.head:  # a further node of a spanning engine: its workers, no engine
        hosted = engines.build_engine(rollout, model, spec, seed=train.seed, deterministic=train.deterministic,
                                      gpus=placements[span.engine].gpus, colocated=False, span=span)
    if engine_id is not None:
        gpus = placements[engine_id].gpus
        if rollout.supervise_engines:  # the engine in a process and failure domain of its own
            from megatron_maspo.rollout.supervision.proxy import SupervisedEngine

            engine = SupervisedEngine.from_settings(rollout, model, spec, seed=train.seed,
                                                    deterministic=train.deterministic, engine_id=engine_id,
                                                    label="supervised engine", gpus=gpus)
            if run_dir is not None:
                from megatron_maspo.rollout.supervision.elastic import ControlDir, ElasticOwner

                elastic = ElasticOwner(ControlDir(run_dir), owner=engine_id, supervisor=engine.supervisor)
        else:
            engine = engines.build_engine(rollout, model, spec, seed=train.seed,
                                          deterministic=train.deterministic, gpus=gpus, colocated=False,
                                          span=span)
        engine.defer_verify = engines.traits(rollout).verifies_beside_generation  # pause = copy-in only
        ((weights, ctl), *more), turns = receiving_end(links)
        receiver = WeightReceiver(weights, ctl, more=more, device=engine.device, staging=engine.staging_pool(),
                                  order=export_order(pools, spec, model.dtype_name), turns=turns)
        shard = make_shard(engine, engine_id=engine_id, fleet=fleet, tokenizer=tokenizer, examples=examples,
                           rollout=rollout, train=train, reward=reward, version_offset=0,
                           meters=PhaseMeters(PhaseMemory(default_device())))
    ignore_stop_signals()  # the trainer decides when the pool stops (after its checkpoint)
    worker = RolloutWorker(shard, fleet, receiver=receiver, batches=batches, rollout=rollout, train=train,
                           num_examples=len(examples), faults=FaultInjector(faults.configured(), pools.rank),
                           elastic=elastic)
    try:
        made = worker.run()
    finally:
        if shard is not None:
            shard.close()
            shard.engine.shutdown()
        if hosted is not None:
            hosted.shutdown()
    if receiver is not None:
        receiver.join()
    logger.info("rollout pool rank %d: %d batches made", pool_rank, made)
    return made
