"""Parallel layout of the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ParallelConfig:
    """Tensor x pipeline x data (x expert) layout; data parallelism is what is left of the world."""

    tp: int = 1
    """Tensor-parallel size (Megatron ``tensor_model_parallel_size``)."""
    pp: int = 1
    """Pipeline-parallel size (``pipeline_model_parallel_size``)."""
    ep: int = 1
    """Expert-parallel size for MoE models (``expert_model_parallel_size``)."""
    cp: int = 1
    """Context-parallel size (``context_parallel_size``): each packed row split over ``cp`` ranks, ring
    attention exchanging K/V between them. ``maspo plan`` models it; the trainer refuses cp > 1 today
    (it builds no context-parallel attention), with a ConfigError before anything is built."""
    vpp: int | None = None
    """Virtual pipeline chunks per stage (interleaved schedule); None disables it."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer, Adam only)."""
    overlap_grad_reduce: bool | None = None
    """Overlap the data-parallel gradient reduce(-scatter) with backward (Megatron DDP buckets).
    None = on when training on GPU with dp > 1; off on CPU (gloo), where it buys nothing."""
    overlap_param_gather: bool | None = None
    """Overlap the distributed optimizer's parameter all-gather with the next forward. Needs
    ``distributed_optimizer`` and ``overlap_grad_reduce``; None = on exactly then (GPU, dp > 1)."""
    world_size: int = 1
    """Processes the job runs on (nodes x GPUs per node); set by the launcher, 1 on the CPU default."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(f"parallel.vpp={self.vpp} needs vpp >= 2 and pp >= 2 (pp={self.pp})")
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(f"parallel.world_size={self.world_size} is not divisible by tp*pp*cp="
                             f"{self.tp * self.pp * self.cp}")

    @property
    def dp(self) -> int:
        """Data-parallel size (derived)."""
        return self.world_size // (self.tp * self.pp * self.cp)
