"""Disaggregated placement: a training pool and a rollout pool in one job, and the groups between them.

Pure arithmetic on the job's size, the rollout pool's size and the trainer's layout (no torch.distributed),
so the trainer, the rollout pool, ``maspo check`` and the planner read the same object.

    global ranks   0 .. T-1           training pool: Megatron's world (TP x CP x EP x DP x PP over T ranks)
                   T .. T+R-1         rollout pool: R = rollout.engine_ranks, E = R / engine_tp engines
    engine e       owned by global rank T + e * engine_tp (its TP workers on the next engine_tp - 1 GPUs)
    groups         each pool's default group holds only that pool's ranks (pool rank = global - first);
                   ``weights`` bridge (device: NCCL on GPUs) and ``weights_ctl`` (host: gloo) on the same
                   ranks: trainer rank 0 (root, a sender) + every engine owner; with
                   ``rollout.sync_senders=stages`` one more such pair per other sender (each stage's first
                   rank, each EP rank: ``weights_s<rank>``), up to ``rollout.max_weight_links`` pairs, the
                   senders beyond sharing them in turns (:attr:`PoolLayout.sender_groups`), or with
                   ``sync_transport=p2p`` one pair per (sender, owner) (:attr:`PoolLayout.weight_links`);
                   ``batches`` bridge (host: pickled batches): the lead engine (root, pool rank 0) + every
                   trainer rank;
                   with several broadcast links, ``weights_parent`` (every sender + every owner): the NCCL
                   communicator each link's payload communicator is split from (:attr:`PoolLayout.bridge_comms`,
                   the list every rank builds its bridges from, in one pass at start-up)

The rollout pool shards each step's prompts over its engines exactly as a colocated fleet does
(:attr:`PoolLayout.fleet` is a :class:`~.fleet.FleetLayout` over the pool), gathers the graded groups inside
the pool, and the lead engine hands the finished batch to every trainer rank in one broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_maspo.parallel.group_plan import HOST, PARENT, PAYLOAD, CommSpec
from megatron_maspo.rollout.engines import engine_tp
from megatron_maspo.rollout.fleet import (
    EnginePlacement,
    FleetLayout,
    check_placement,
    place_engine,
)
from megatron_maspo.rollout.transfer_plan import TrainerLayout

TRAIN, ROLLOUT = "train", "rollout"


@dataclass(frozen=True)
class WeightLink:
    """Bridges from one or more senders to some engine owners: ``name`` (device payloads) and
    ``name + "_ctl"`` or, for trainer rank 0's broadcast link, ``weights_ctl`` (host headers).

    ``ranks[:senders]`` are the senders, in the order they take turns (ascending rank), then the owners.
    Every member takes part in every turn: turn ``t`` is a broadcast of sender ``t``'s buckets from member
    index ``t`` (``pool_sync``)."""

    name: str
    ranks: tuple[int, ...]
    senders: int = 1

    @property
    def ctl_name(self) -> str:
        return "weights_ctl" if self.name == "weights" else f"{self.name}_ctl"

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        return self.ranks[:self.senders]


@dataclass(frozen=True, kw_only=True)
class PoolLayout:
    """Which ranks train, which generate, and who talks to whom (immutable, picklable)."""

    world: int
    """Processes in the job (both pools)."""
    engine_ranks: int
    """R: ranks of the rollout pool (``rollout.engine_ranks``)."""
    rollout_tp: int = 1
    """GPUs per engine."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int | None = None
    pp_first: int | None = None
    """Layers of the first / last pipeline stage of an uneven split; None = even."""
    pp_last: int | None = None
    sync_senders: str = "stages"
    """``rollout.sync_senders``: ``"stages"`` (each stage / EP rank sends its own tensors) or ``"rank0"``."""
    sync_transport: str = "broadcast"
    """``rollout.sync_transport``: ``"broadcast"`` (a bridge per sender) or ``"p2p"`` (per sender and owner)."""
    moe: bool = False
    """The model has routed experts (its EP ranks send their own experts)."""
    max_links: int = 16
    """``rollout.max_weight_links``: most broadcast links; more senders share them, taking turns."""

    def __post_init__(self) -> None:
        if not 1 <= self.engine_ranks < self.world:
            raise ValueError(f"pools: rollout.engine_ranks={self.engine_ranks} must leave at least one of the "
                             f"job's {self.world} ranks to train (1 <= engine_ranks < world)")
        if self.engine_ranks % self.rollout_tp:
            raise ValueError(f"pools: engine TP {self.rollout_tp} does not divide rollout.engine_ranks="
                             f"{self.engine_ranks}")
        mp = self.tp * self.pp * self.cp
        if self.trainer_world % mp:
            raise ValueError(f"pools: the training pool's {self.trainer_world} ranks are not a multiple of "
                             f"tp*pp*cp={mp}")
        stage = self.trainer_world // self.pp
        if self.moe and self.ep > 1 and stage % self.ep:  # Megatron's expert grid: expert-DP = tp*cp*dp / ep
            raise ValueError(f"pools: tp*cp*dp = {stage} (the training pool's ranks per stage) is not divisible by "
                             f"ep={self.ep} (Megatron's expert data parallelism is tp*cp*dp / ep)")

        if self.sync_transport == "broadcast":
            self.sender_groups  # noqa: B018 -- refuses a link cap its dense TP groups cannot meet, now

    @property
    def trainer_world(self) -> int:
        """T: ranks of the training pool."""
        return self.world - self.engine_ranks

    @property
    def dp(self) -> int:
        return self.trainer_world // (self.tp * self.pp * self.cp)

    @property
    def fleet(self) -> FleetLayout:
        """The engines inside the rollout pool (pool ranks; owners at ``e * rollout_tp``)."""
        return FleetLayout(world=self.engine_ranks, rollout_tp=self.rollout_tp)

    @property
    def num_engines(self) -> int:
        return self.engine_ranks // self.rollout_tp

    def role(self, rank: int) -> str:
        """``"train"`` or ``"rollout"`` for global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"pools: rank {rank} outside the job of {self.world}")
        return TRAIN if rank < self.trainer_world else ROLLOUT

    def pool_rank(self, rank: int) -> int:
        """``rank``'s index inside its own pool (its rank in the pool's default group)."""
        return rank if self.role(rank) == TRAIN else rank - self.trainer_world

    @property
    def owner_ranks(self) -> tuple[int, ...]:
        """Global rank of each engine's owner, in engine order."""
        return tuple(self.trainer_world + r for r in self.fleet.engine_ranks)

    @property
    def lead_engine_rank(self) -> int:
        """Global rank of engine 0's owner: it hands each finished batch to the trainers."""
        return self.trainer_world

    @property
    def weights_ranks(self) -> tuple[int, ...]:
        """Members of the ``weights`` bridge: the sender (trainer rank 0) first, then the owners."""
        return (0, *self.owner_ranks)

    @property
    def trainer_layout(self) -> TrainerLayout:
        """The training pool's layout as the transfer plan reads it."""
        return TrainerLayout(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, ep=self.ep, vpp=self.vpp,
                             pp_first=self.pp_first, pp_last=self.pp_last)

    @property
    def sender_ranks(self) -> tuple[int, ...]:
        """Trainer ranks that send weights (``rollout.sync_senders``), ascending; rank 0 first."""
        if self.sync_senders == "rank0":
            return (0,)
        return self.trainer_layout.senders(moe=self.moe)

    @property
    def weight_links(self) -> tuple[WeightLink, ...]:
        """Every (payload, header) bridge pair of the weight transfer, in the order every rank builds them.

        ``broadcast``: one link per :attr:`sender_groups` entry (one sender each up to ``max_links``), with
        every owner (rank 0's keeps the names ``weights`` / ``weights_ctl``); ``p2p``: one link per
        (sender, owner) pair.
        """
        if self.sync_transport == "p2p":
            return tuple(WeightLink(f"weights_s{s}_o{o}", (s, o)) for s in self.sender_ranks for o in self.owner_ranks)
        return tuple(WeightLink("weights" if g[0] == 0 else f"weights_s{g[0]}", (*g, *self.owner_ranks), len(g))
                     for g in self.sender_groups)

    @property
    def sender_groups(self) -> tuple[tuple[int, ...], ...]:
        """The senders of each broadcast link, ascending within a link (their turn order); trainer rank 0
        opens the first.

        At most ``max_links`` links: sender ``i`` (in rank order) goes to link ``i mod L``, or the next
        link without a conflict. Two senders conflict when they lie in one TP group that exports dense
        tensors (a dense sender's: its TP peers join its gathers), since a sender waiting for its turn
        stops exporting after two buckets: if the sender before it on the link needed its gathers, neither
        would move. Senders of other TP groups export with no collective.

        Raises:
            ValueError: ``max_links`` is below the senders of one dense TP group.
        """
        senders = self.sender_ranks
        n = min(len(senders), self.max_links)
        dense = {self.trainer_layout.dense_sender(s) for s in range(self.pp)}
        groups: list[list[int]] = [[] for _ in range(n)]
        busy: list[set[int]] = [set() for _ in range(n)]  # dense TP groups (first rank) with a sender on a link
        for i, s in enumerate(senders):
            tp_group = s - s % self.tp
            key = tp_group if tp_group in dense else None
            for k in (*range(i % n, n), *range(i % n)):
                if key is None or key not in busy[k]:
                    break
            else:
                raise ValueError(f"pools: rollout.max_weight_links={self.max_links} is below the {self.tp} senders "
                                 f"of the TP group at rank {tp_group}, which may not share a link: raise it to >= {self.tp}")
            groups[k].append(s)
            if key is not None:
                busy[k].add(key)
        return tuple(tuple(g) for g in groups if g)

    @property
    def bridge_comms(self) -> tuple[CommSpec, ...]:
        """Every group between the pools, in the one order every rank builds them (``train/rollouts/pool.py``)
        and ``maspo check`` counts them: :attr:`weight_links`' payload and header groups, then ``batches``.

        With more than one broadcast link a ``weights_parent`` over every sender and owner comes first, and
        each link's payload communicator is an ``ncclCommSplit`` of it (colour = the link's index): made at
        start-up from one bootstrap, every member of the parent taking part in each split. ``p2p`` pairs
        are made on their own (a split would involve every sender and owner once per pair).
        """
        links = self.weight_links
        out: list[CommSpec] = []
        parent = None
        if self.sync_transport == "broadcast" and len(links) > 1:
            parent = "weights_parent"
            out.append(CommSpec(parent, tuple(dict.fromkeys((*self.sender_ranks, *self.owner_ranks))), PARENT))
        for i, link in enumerate(links):
            out += [CommSpec(link.name, link.ranks, PAYLOAD, parent, i, link.senders),
                    CommSpec(link.ctl_name, link.ranks, HOST, roots=link.senders)]
        out.append(CommSpec("batches", self.batches_ranks, HOST))
        return tuple(out)

    @property
    def batches_ranks(self) -> tuple[int, ...]:
        """Members of the ``batches`` bridge: the lead engine first, then every trainer rank."""
        return (self.lead_engine_rank, *range(self.trainer_world))

    def placement(self, gpus_per_node: int) -> tuple[EnginePlacement, ...]:
        """Every engine's owner, node(s) and node-local GPUs (ranks node-major, one GPU each; no sharing; an
        engine larger than a node on whole nodes: :func:`~.fleet.place_engine`).

        Raises:
            ValueError: an engine would take part of a second node.
        """
        if gpus_per_node < 1:
            raise ValueError(f"pools: gpus_per_node must be >= 1, got {gpus_per_node}")
        out = tuple(place_engine(e, owner, self.rollout_tp, gpus_per_node) for e, owner in enumerate(self.owner_ranks))
        check_placement(out)
        return out

    def describe(self, num_prompts: int) -> str:
        """One line for logs and the planner."""
        sizes = self.fleet.shard_sizes(num_prompts)
        return (f"disaggregated: ranks 0-{self.trainer_world - 1} train; {self.num_engines} engine(s) of "
                f"rollout TP {self.rollout_tp} on ranks {self.trainer_world}-{self.world - 1}; "
                f"{min(sizes)}-{max(sizes)} prompt groups per engine")


def build_pools(parallel, rollout, world: int) -> PoolLayout | None:
    """The disaggregated layout of a job of ``world`` ranks, or None for the colocated placement."""
    if rollout.placement != "disaggregated":
        return None
    p = parallel
    return PoolLayout(world=world, engine_ranks=rollout.engine_ranks, rollout_tp=engine_tp(rollout),
                      tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, vpp=p.vpp, pp_first=p.pp_first_layers,
                      pp_last=p.pp_last_layers, sync_senders=rollout.sync_senders,
                      sync_transport=rollout.sync_transport, moe=p.ep > 1, max_links=rollout.max_weight_links)
