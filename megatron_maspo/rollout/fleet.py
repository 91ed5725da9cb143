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

Every replica that contains an owner runs the HF export once per sync and each owner in it packs its own
engine's buckets; replicas without an owner skip the export. Nothing crosses replicas, except with expert
parallelism (the expert gather spans data-parallel ranks, so every rank joins the export).
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def joins_export(self, rank: int) -> bool:
        """Whether ``rank`` iterates the HF export in a sync: its replica feeds an engine (or EP > 1)."""
        if self.ep > 1:
            return True
        mine = self.replica_of(rank)
        return any(self.replica_of(r) == mine for r in self.engine_ranks)

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


def rollout_tp_of(rollout_cfg) -> int:
    """GPUs per engine for a ``RolloutConfig``: ``vllm_tp`` for vLLM, 1 for the single-device built-in engine."""
    return rollout_cfg.vllm_tp if rollout_cfg.engine == "vllm" else 1


def build_fleet(parallel, rollout, world: int | None = None) -> FleetLayout:
    """The layout for a run's ``parallel`` and ``rollout`` sections on ``world`` processes (default
    ``parallel.world_size``)."""
    p = parallel
    return FleetLayout(world=p.world_size if world is None else world, rollout_tp=rollout_tp_of(rollout),
                       tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)


def _short(ranks: tuple[int, ...]) -> str:
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    step = ranks[1] - ranks[0]
    return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} (every {step})"
