"""Parallel layout of the trainer."""

from __future__ import annotations

from dataclasses import dataclass

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
GPU_TYPES = ("h100", "h200")
"""GPUs the planner has figures for (``launch/plan/types.py::GPU_FIGURES``)."""


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
    """Context-parallel size (``context_parallel_size``): each packed sequence padded to a multiple of
    ``2·cp`` and split over ``cp`` ranks in Megatron's load-balanced order; K/V are exchanged between
    them (``packed_sdpa``: all-gathered; TE: ``cp_comm_type``). Budgets count tokens per CP rank."""
    cp_comm_type: str = "p2p"
    """Transformer Engine's CP exchange on the TE spec: ``"p2p"`` (ring), ``"all_gather"``, ``"a2a"``
    or ``"a2a+p2p"``. The local spec's ``packed_sdpa`` always all-gathers."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism at TP > 1: norms, residuals and the MoE dispatch work on ``S/TP``
    rows per TP rank (reduce-scatter / all-gather around attention and MLP instead of all-reduce).
    None (default) = on with ``model.attention_backend="te"`` and for MoE models (Megatron refuses
    MoE x TP without it), off otherwise; True/False force it (False with MoE at TP > 1 is refused).
    Ignored at TP 1."""
    vpp: int | None = None
    """Virtual pipeline chunks per stage (interleaved schedule); None disables it."""
    pp_first_layers: int | None = None
    """Decoder layers on the first pipeline stage (Megatron's ``num_layers_in_first_pipeline_stage``);
    None = its even share. With ``pp_last_layers``, for layer counts that ``pp`` does not divide
    (DeepSeek-V3's 61 at PP 16: ``pp_first_layers=1``, then 4 per stage): the stages between share
    what is left evenly (``parallel/pipeline_split.py``)."""
    pp_last_layers: int | None = None
    """Decoder layers on the last pipeline stage (``num_layers_in_last_pipeline_stage``); None = its
    even share. A lighter last stage leaves room for the LM head and the loss."""
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
    gpu: str = "h100"
    """The GPU the layout is sized for: ``maspo plan`` and ``maspo check`` take its memory, bf16 peak and HBM
    bandwidth from it (``"h100"``: H100 SXM 80 GB; ``"h200"``: H200 SXM 141 GB). The trainer does not read it."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu not in GPU_TYPES:
            raise ValueError(f"parallel.gpu={self.gpu!r}; accepted: {list(GPU_TYPES)}")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type!r}; accepted: {CP_COMM_TYPES}")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(f"parallel.vpp={self.vpp} needs vpp >= 2 and pp >= 2 (pp={self.pp})")
        for name in ("pp_first_layers", "pp_last_layers"):
            n = getattr(self, name)
            if n is not None and (n < 1 or self.pp < 2):
                raise ValueError(f"parallel.{name}={n} needs pp >= 2 and at least one layer (pp={self.pp})")
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(f"parallel.world_size={self.world_size} is not divisible by tp*pp*cp="
                             f"{self.tp * self.pp * self.cp}")

    @property
    def dp(self) -> int:
        """Data-parallel size (derived)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    def pipeline_split(self, num_layers: int):
        """This layout's :class:`~.pipeline_split.PipelineSplit` of ``num_layers`` (``ValueError`` if
        Megatron-Core cannot build it)."""
        from megatron_maspo.parallel.pipeline_split import PipelineSplit

        return PipelineSplit(num_layers, self.pp, self.vpp, self.pp_first_layers, self.pp_last_layers)


def sequence_parallel_on(setting: bool | None, backend: str, tp: int, is_moe: bool) -> bool:
    """Whether a run uses Megatron sequence parallelism: never at TP 1; ``setting``
    (``parallel.sequence_parallel``) when given; else (None, the default) on with the TE backend (its thd
    packing expects it) and for MoE models (Megatron refuses MoE x TP without it), off otherwise."""
    if tp == 1:
        return False
    if setting is not None:
        return setting
    return backend == "te" or is_moe
