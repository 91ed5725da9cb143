"""The rollout fleet's layout: which ranks own an engine, which prompts each one generates, who feeds it.

Pure arithmetic on the world size, the rollout TP and the trainer's TP x PP layout (no torch.distributed),
so the trainer, the weight sync and the planner all read the same object.

Colocated design (one engine per rollout-TP group over the whole world, ``world / rollout_tp`` engines):

    engine e      owned by global rank  e * rollout_tp     (vLLM spawns its TP workers from there)
    prompts of e  contiguous slice [start_e, start_e + n_e) of the step's P prompt groups,
                  n_e = P // E (+1 for the first P % E engines): whole groups of G responses stay together
    fed by        the model-parallel (TP x PP) replica that contains the owner rank:
                  dp index = (owner // (tp·cp)) % dp   (Megatron orders ranks tp-cp-ep-dp-pp; the CP
                  ranks of a replica hold identical weights, so an owner at cp_rank > 0 exports its own copy)
    placed on     node  owner // gpus_per_node, local GPUs  owner % gpus_per_node + 0 .. rollout_tp - 1
                  (ranks are node-major, one process per GPU, LOCAL_RANK = GPU index: torchrun and srun
                  block placement), i.e. the GPUs of the ranks owner .. owner + rollout_tp - 1; an engine
                  larger than a node takes whole nodes (rollout_tp a multiple of gpus_per_node: vLLM's
                  multi-node TP), none takes part of a second node, and no two engines share a GPU
                  (:meth:`FleetLayout.placement`)

Every TP x PP group that contains an owner runs the HF export once per sync and each owner in it packs its
own engine's buckets; groups without an owner skip the export: other replicas, and with CP the other CP
ranks of a replica (a replica is cp TP x PP groups holding identical weights; Megatron's model-parallel
group is one of them, :meth:`FleetLayout.export_group_of`). Nothing crosses groups, except with expert
parallelism (the expert gather spans data-parallel ranks, so every rank joins the export).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_maspo.parallel.device import on_cuda
from megatron_maspo.rollout.engines import engine_tp


@dataclass(frozen=True, kw_only=True)
class FleetLayout:
    """Engine placement and prompt sharding for one job (immutable, cheap, picklable)."""

    world: int
    """Processes in the job."""
    rollout_tp: int
    """GPUs per engine (``rollout.vllm_tp`` for vLLM, 1 for the built-in engine)."""
    tp: int = 1
    """Trainer tensor-parallel size."""
    pp: int = 1
    """Trainer pipeline-parallel size."""
    ep: int = 1
    """Trainer expert-parallel size (> 1: every rank joins the export)."""

    cp: int = 1
    """The trainer's context-parallel size (rows split, weights replicated over CP)."""

    def __post_init__(self) -> None:
        if self.world < 1 or self.rollout_tp < 1 or self.tp < 1 or self.pp < 1 or self.ep < 1 or self.cp < 1:
            raise ValueError(f"fleet: sizes must be >= 1 (world={self.world}, rollout_tp={self.rollout_tp}, "
                             f"tp={self.tp}, pp={self.pp}, ep={self.ep})")
        if self.world % self.rollout_tp:
            raise ValueError(f"fleet: rollout TP {self.rollout_tp} does not divide the world size {self.world}")
        if self.world % (self.tp * self.pp * self.cp):
            raise ValueError(f"fleet: tp*pp*cp={self.tp * self.pp * self.cp} does not divide the world "
                             f"size {self.world}")

    @property
    def num_engines(self) -> int:
        """E = world / rollout_tp."""
        return self.world // self.rollout_tp

    @property
    def dp(self) -> int:
        """Trainer data-parallel size (model-parallel replicas)."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        """Global rank owning each engine, in engine order."""
        return tuple(e * self.rollout_tp for e in range(self.num_engines))

    def engine_of(self, rank: int) -> int | None:
        """The engine global ``rank`` owns, or None."""
        if not 0 <= rank < self.world:
            raise ValueError(f"fleet: rank {rank} outside the world of {self.world}")
        return rank // self.rollout_tp if rank % self.rollout_tp == 0 else None

    def replica_of(self, rank: int) -> int:
        """Data-parallel index of the model-parallel replica that holds global ``rank``."""
        return (rank // (self.tp * self.cp)) % self.dp

    def feeding_replica(self, engine: int) -> int:
        """Data-parallel index of the replica whose export feeds ``engine``."""
        return self.replica_of(self.engine_ranks[engine])

    # ------------------------------------------------------------------ device placement (data)
    def _check_gpus_per_node(self, gpus_per_node: int) -> None:
        if gpus_per_node < 1:
            raise ValueError(f"fleet: gpus_per_node must be >= 1, got {gpus_per_node}")
        if self.world > gpus_per_node and self.world % gpus_per_node:
            raise ValueError(f"fleet: {self.world} ranks do not fill whole nodes of {gpus_per_node} GPUs")

    def engine_node(self, engine: int, gpus_per_node: int) -> int:
        """The node (0-based, in rank order) that runs ``engine``: its owner's, ``owner // gpus_per_node``."""
        self._check_gpus_per_node(gpus_per_node)
        return self.engine_ranks[engine] // gpus_per_node

    def engine_gpus(self, engine: int, gpus_per_node: int) -> tuple[int, ...]:
        """Node-local GPU indices of ``engine``'s workers on each of its nodes, in vLLM TP-rank order.

        Within a node: the GPUs of the ranks ``owner .. owner + rollout_tp - 1``, ``owner % gpus_per_node + k``
        (length ``rollout_tp``). An engine larger than a node takes whole nodes: every GPU of each
        (``range(gpus_per_node)``, its TP ranks node-major). They are indices as the trainer's processes see
        the node (``LOCAL_RANK`` = GPU index); :func:`cuda_visible_devices` maps them through a
        ``CUDA_VISIBLE_DEVICES`` the job itself was started under.

        Raises:
            ValueError: the engine would take part of a second node (see :func:`place_engine`).
        """
        return self.placement_of(engine, gpus_per_node).gpus

    def placement_of(self, engine: int, gpus_per_node: int) -> EnginePlacement:
        """Where ``engine`` runs (:func:`place_engine` of its owner)."""
        self._check_gpus_per_node(gpus_per_node)
        return place_engine(engine, self.engine_ranks[engine], self.rollout_tp, gpus_per_node)

    def placement(self, gpus_per_node: int) -> tuple[EnginePlacement, ...]:
        """Every engine's owner rank, node(s) and local GPUs (checked: no GPU is claimed twice)."""
        out = tuple(self.placement_of(e, gpus_per_node) for e in range(self.num_engines))
        check_placement(out)
        return out

    def export_group_of(self, rank: int) -> int:
        """Index of the TP x PP group (Megatron's model-parallel group: one CP rank of one replica) that
        holds global ``rank``: ``(rank // tp) % (cp * dp)``, i.e. ``cp_rank + cp * dp_rank``."""
        return (rank // self.tp) % (self.cp * self.dp)

    def joins_export(self, rank: int) -> bool:
        """Whether ``rank`` iterates the HF export in a sync: its TP x PP group holds an engine owner (or
        EP > 1). With CP, only the owners' CP ranks export, not every CP rank of their replicas."""
        if self.ep > 1:
            return True
        mine = self.export_group_of(rank)
        return any(self.export_group_of(r) == mine for r in self.engine_ranks)

    def shard_sizes(self, num_prompts: int) -> list[int]:
        """Prompt groups per engine, ``[E]``, balanced (the first ``P % E`` engines get one more)."""
        if num_prompts < 0:
            raise ValueError(f"fleet: num_prompts must be >= 0, got {num_prompts}")
        q, r = divmod(num_prompts, self.num_engines)
        return [q + (e < r) for e in range(self.num_engines)]

    def shard(self, num_prompts: int, engine: int) -> range:
        """Positions (in the step's prompt order) of the groups ``engine`` generates; may be empty."""
        sizes = self.shard_sizes(num_prompts)
        start = sum(sizes[:engine])
        return range(start, start + sizes[engine])

    def describe(self, num_prompts: int) -> str:
        """One line for logs and the planner."""
        sizes = self.shard_sizes(num_prompts)
        return (f"{self.num_engines} engine(s) of rollout TP {self.rollout_tp} on ranks "
                f"{_short(self.engine_ranks)}; {min(sizes)}-{max(sizes)} prompt groups per engine")


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine runs: what ``maspo check``, the logs and :class:`~.vllm_engine.VllmEngine` read."""

    engine: int
    owner: int
    """Global rank that starts the engine (the leader of its first node)."""
    node: int
    """The owner's node: the engine's first."""
    gpus: tuple[int, ...]
    """Node-local GPU indices of its workers on each of its nodes (TP-rank order within a node)."""
    nodes: int = 1
    """Nodes it spans: an engine larger than a node takes ``rollout_tp / gpus_per_node`` whole nodes."""

    @property
    def tp(self) -> int:
        """The engine's tensor-parallel size (GPUs in all)."""
        return len(self.gpus) * self.nodes

    @property
    def node_ids(self) -> tuple[int, ...]:
        """Every node it runs on, the owner's first."""
        return tuple(range(self.node, self.node + self.nodes))

    @property
    def leaders(self) -> tuple[int, ...]:
        """Global rank of the first process on each of its nodes, the owner first: on every node after the
        first, that rank starts the engine's workers of the node (vLLM's headless node, ``node_rank > 0``)."""
        return tuple(self.owner + k * len(self.gpus) for k in range(self.nodes))

    def node_rank_of(self, rank: int) -> int | None:
        """Which of the engine's nodes global ``rank`` leads (0 for the owner), or None."""
        return self.leaders.index(rank) if rank in self.leaders else None


def place_engine(engine: int, owner: int, tp: int, gpus_per_node: int) -> EnginePlacement:
    """The placement of an engine of ``tp`` GPUs owned by global rank ``owner`` (ranks node-major, one GPU
    each): inside the owner's node, or, larger than a node, on ``tp / gpus_per_node`` whole nodes from the
    owner's (vLLM's multi-node TP: its all-reduces then cross the inter-node network).

    Raises:
        ValueError: the engine would take part of a second node (within a node rollout TP must divide the
            GPUs per node; beyond one, be a multiple of it, so an engine never shares a node it spans).
    """
    first, node = owner % gpus_per_node, owner // gpus_per_node
    if tp <= gpus_per_node:
        if first + tp > gpus_per_node:
            raise ValueError(f"fleet: engine {engine} (ranks {owner}..{owner + tp - 1}) spans two nodes of "
                             f"{gpus_per_node} GPUs: rollout TP {tp} must divide the GPUs per node")
        return EnginePlacement(engine=engine, owner=owner, node=node, gpus=tuple(range(first, first + tp)))
    if tp % gpus_per_node or first:
        raise ValueError(f"fleet: engine {engine} (ranks {owner}..{owner + tp - 1}, rollout TP {tp}) would take "
                         f"part of a node of {gpus_per_node} GPUs: an engine larger than a node takes whole "
                         f"nodes, so rollout TP must be a multiple of {gpus_per_node}")
    return EnginePlacement(engine=engine, owner=owner, node=node, gpus=tuple(range(gpus_per_node)),
                           nodes=tp // gpus_per_node)


def check_placement(placements: Sequence[EnginePlacement]) -> None:
    """Raise ``ValueError`` naming the first GPU two engines would share (vLLM's start-up memory check, or
    two engines' KV caches on one device, would fail on the cluster)."""
    seen: dict[tuple[int, int], int] = {}
    for p in placements:
        if len(set(p.gpus)) != len(p.gpus):
            raise ValueError(f"fleet: engine {p.engine} lists GPU(s) {p.gpus} with repeats")
        for node in p.node_ids:
            for g in p.gpus:
                other = seen.setdefault((node, g), p.engine)
                if other != p.engine:
                    raise ValueError(f"fleet: engines {other} and {p.engine} both placed on node {node} GPU {g}")


def processes_per_node(world: int, env: Mapping[str, str] | None = None) -> int:
    """Trainer processes (= GPUs) per node of this job: ``LOCAL_WORLD_SIZE`` (torchrun), else
    ``SLURM_NTASKS_PER_NODE`` (srun-native launch), else the visible CUDA devices, else ``world`` (one node)."""
    env = os.environ if env is None else env
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = env.get(key, "")
        if v.isdigit() and int(v) > 0:
            return min(int(v), world)
    import torch

    if on_cuda():
        return min(torch.cuda.device_count(), world)
    return world


def owner_gpus(fleet: FleetLayout, rank: int, env: Mapping[str, str] | None = None, *,
               cuda: bool | None = None) -> tuple[int, ...] | None:
    """The local GPUs of the engine ``rank`` owns (None when it owns none), checked against its ``LOCAL_RANK``.

    Raises:
        RuntimeError: the launcher did not place ranks node-major (the owner's ``LOCAL_RANK`` is not the
            first GPU the layout gives its engine).
    """
    env = os.environ if env is None else env
    engine = fleet.engine_of(rank)
    if engine is None:
        return None
    gpus = fleet.engine_gpus(engine, processes_per_node(fleet.world, env))
    local = env.get("LOCAL_RANK")
    if not (on_cuda() if cuda is None else cuda):  # CPU ranks claim no device: the placement is data only
        return gpus
    if local is not None and local.isdigit() and int(local) != gpus[0]:
        raise RuntimeError(f"fleet: rank {rank} has LOCAL_RANK={local}, but the layout places its engine on "
                           f"local GPUs {gpus}: launch ranks node-major (torchrun / srun block placement)")
    return gpus


def cuda_visible_devices(gpus: Sequence[int], parent: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that exposes exactly ``gpus`` (node-local indices as the trainer
    sees them), in order: the indices themselves, or the matching entries of the job's own ``parent`` list.

    Raises:
        ValueError: an index beyond the ``parent`` list.
    """
    if not gpus:
        raise ValueError("fleet: an engine needs at least one GPU")
    if parent is None or parent.strip() == "":
        return ",".join(str(g) for g in gpus)
    ids = [p.strip() for p in parent.split(",") if p.strip()]
    bad = [g for g in gpus if not 0 <= g < len(ids)]
    if bad:
        raise ValueError(f"fleet: GPU index {bad[0]} is outside CUDA_VISIBLE_DEVICES={parent!r}")
    return ",".join(ids[g] for g in gpus)


def build_fleet(parallel, rollout, world: int | None = None) -> FleetLayout:
    """The layout for a run's ``parallel`` and ``rollout`` sections on ``world`` processes (default
    ``parallel.world_size``)."""
    p = parallel
    return FleetLayout(world=p.world_size if world is None else world, rollout_tp=engine_tp(rollout),
                       tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)


def _short(ranks: tuple[int, ...]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    step = ranks[1] - ranks[0]
    return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} (every {step})"
