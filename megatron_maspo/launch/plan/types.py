"""The planner's data: hardware assumptions, the layout searched over, and the figures it reports.

Formulas: the docstring of ``launch/plan/estimator.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_maspo.launch.plan.memory import rollout_trace

if TYPE_CHECKING:
    from megatron_maspo.rollout.fleet import FleetLayout

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """Hardware figures and efficiencies the estimate rests on (defaults: H100-SXM-80G, performance-model.md §1)."""

    gpu_mem_gb: float = 80.0
    """Usable GPU memory in GiB."""
    peak_tflops: float = 989.0
    """Dense bf16 tensor peak per GPU (H100/H200 SXM)."""
    hbm_tb_s: float = 3.35
    """HBM bandwidth, TB/s (H100 3.35, H200 4.8)."""
    mfu: float = 0.35
    """Model-FLOPs utilisation of dense trainer forward/backward at a per-GPU GEMM width of
    ``mfu_ref_width`` and micro-batches of at least ``mfu_ref_tokens`` (RL update phases: 0.2-0.4); other
    shapes scale it by ``launch/plan/model.py::gemm_mfu``."""
    mfu_ref_width: int = 2048
    """Per-GPU GEMM width (hidden / TP) at which ``mfu`` holds: the width of the calibration rows it was
    chosen on (Llama-3.1-8B at TP 2, 70B at TP 4, Qwen3-30B-A3B at TP 1: 2048; Qwen3-32B at TP 4: 1280)."""
    mfu_ref_tokens: int = 4096
    """Micro-batch tokens (the GEMMs' M dimension) from which ``mfu`` holds (Megatron's published
    figures are at 4,096-token sequences)."""
    moe_expert_mfu: float = 0.03
    """Utilisation of the routed-expert FLOPs: grouped GEMMs on small experts and load imbalance (the token
    all-to-all is its own term, launch/plan/moe_comm.py). 0.03 puts Qwen3-30B-A3B's whole-model rate,
    all-to-all included, at ~51 TFLOP/s per GPU, inside the absolute rate verl reports for its Megatron MoE
    actor (MFU 0.31-0.40 of a 148 TFLOP/s H20, 46-59 TFLOP/s); docs/planner-calibration.md."""
    decode_bw_eff: float = 0.45
    """Fraction of HBM bandwidth a decode step turns into useful weight + KV reads, all per-step costs
    (scheduling, sampling, log-prob return, kernel launch gaps) included; docs/planner-calibration.md."""
    decode_step_ms: float = 2.0
    """Fixed cost of one decode step of an engine besides its weight and KV reads (scheduling, sampling,
    input preparation, kernel launches), milliseconds; docs/planner-calibration.md gives its source."""
    grade_items_per_s: float = 22.0
    """math-verify grading throughput per reward worker (reward.num_workers per engine rank), items/s:
    the low end of ``python scripts/bench_reward.py`` (22-37 items/s per worker on the dev machine)."""
    sync_gb_s: float = 10.0
    """Weight-sync bandwidth the transport achieves, GB/s (published colocated refits: 3-15)."""
    sync_fixed_s: float = 3.0
    """Per-refit fixed cost: waking the engine, resetting its prefix cache, per-tensor metadata, seconds."""
    prompt_mean: float | None = None
    """Mean prompt tokens; None: ``prompt_frac`` x data.max_prompt_tokens."""
    response_mean: float | None = None
    """Mean response tokens; None: ``response_frac`` x rollout.max_new_tokens."""
    response_max: float | None = None
    """Longest response of one engine's batch (the straggler tail); None: rollout.max_new_tokens."""
    nvlink_gb_s: float = 150.0
    """Point-to-point bandwidth between GPUs of one node (context-parallel ring, MoE all-to-all), GB/s."""
    internode_gb_s: float = 40.0
    """Point-to-point bandwidth between nodes per GPU (400 Gb/s InfiniBand at ~80%), GB/s."""
    host_gb_s: float = 20.0
    """Pinned host <-> GPU copy bandwidth per GPU for trainer offload (PCIe Gen5 x16, shared), GB/s."""
    p2p_latency_us: float = 20.0
    """Fixed cost of one ring hop or one MoE all-to-all (launch + synchronisation), microseconds."""
    controller_gb_s: float | None = None
    """A single controller's batch (de)serialisation rate, GB/s (launch/plan/dispatch.py); None: no controller."""
    reserve_gb: float = 3.0
    """CUDA context, NCCL buffers and allocator fragmentation, GiB."""
    engine_overhead_gb: float = 2.0
    """vLLM activations / CUDA graphs inside its memory share, GiB."""
    prompt_frac: float = 0.5
    """Average prompt length as a fraction of the prompt budget (data.max_prompt_tokens)."""
    response_frac: float = 0.5
    """Average response length as a fraction of ``rollout.max_new_tokens``."""


GPU_FIGURES: dict[str, dict[str, float]] = {
    # H100 SXM 80 GB: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3 (NVIDIA H100 datasheet)
    "h100": dict(gpu_mem_gb=80.0, peak_tflops=989.0, hbm_tb_s=3.35),
    # H200 SXM: the same GPU die (989 dense bf16 TFLOP/s) with 141 GB of HBM3e at 4.8 TB/s (NVIDIA H200
    # datasheet); 139 GiB is what the planner counts as usable (the driver reports about 140 GiB)
    "h200": dict(gpu_mem_gb=139.0, peak_tflops=989.0, hbm_tb_s=4.8),
}
"""Per-GPU figures by ``parallel.gpu``; the other :class:`Assumptions` fields do not depend on the GPU."""


def gpu_assumptions(gpu: str, **overrides) -> Assumptions:
    """:class:`Assumptions` for ``gpu`` (a ``GPU_FIGURES`` key), any field overridden by ``overrides``."""
    if gpu not in GPU_FIGURES:
        raise ValueError(f"unknown GPU {gpu!r}; accepted: {sorted(GPU_FIGURES)}")
    return Assumptions(**{**GPU_FIGURES[gpu], **overrides})


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The knobs the planner searches over."""

    tp: int
    pp: int
    ep: int = 1
    vpp: int | None = None
    recompute: str | None = None
    distributed_optimizer: bool = False
    vllm_tp: int = 1
    cp: int = 1
    pp_first: int | None = None
    """Layers of the first / last pipeline stage of an uneven split (``parallel.pp_first_layers`` /
    ``pp_last_layers``; ``parallel/pipeline_split.py``); None = even."""
    pp_last: int | None = None

    def split(self, num_layers: int):
        """This layout's :class:`~megatron_maspo.parallel.pipeline_split.PipelineSplit` (``ValueError`` if
        Megatron-Core cannot build it)."""
        from megatron_maspo.parallel.pipeline_split import PipelineSplit

        return PipelineSplit(num_layers, self.pp, self.vpp, self.pp_first, self.pp_last)

    def stage_layer_count(self, num_layers: int) -> int:
        """Layers of the busiest pipeline stage (what bounds its activations and its pipeline time);
        ``ceil(L / pp)`` for a split Megatron refuses (the refusal is reported elsewhere)."""
        try:
            return self.split(num_layers).max_stage_layers
        except ValueError:
            return -(-num_layers // self.pp)


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Per-GPU memory in GiB (see the module docstring for each formula)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logprob: float
    engine: float
    reserve: float
    attention: float = 0.0
    """Attention memory beyond ``activations``: the dense-mask path's [S, S] tensors; 0 on packed paths."""
    attention_backend: str = "packed_sdpa"
    reference: float = 0.0
    """The frozen reference model's weights (train.reference_model), resident like the actor's."""
    offloaded: dict[str, float] = field(default_factory=dict)
    """GiB per GPU moved to host memory during generation, by offload category (launch/plan/memory.py)."""
    engine_weights: float | None = None
    """The engine's weights inside ``engine``, GiB; None: the whole share wakes at once (no phase order)."""
    sync_bucket: float = 0.0
    """One weight-sync bucket (rollout.bucket_mb) in flight during the sync, GiB."""

    @property
    def host(self) -> float:
        """Pinned host memory per GPU the offload needs, GiB."""
        return sum(self.offloaded.values())

    @property
    def train_peak(self) -> float:
        return (self.weights + self.reference + self.grads + self.optimizer + self.activations
                + self.attention + self.logprob + self.reserve)

    def _phase_terms(self) -> dict[str, float]:
        w = self.engine if self.engine_weights is None else self.engine_weights
        early = self.offloaded.get("grads", 0.0) + self.offloaded.get("optimizer", 0.0)
        return {"trainer_state": self.weights + self.reference + self.grads + self.optimizer,
                "reserve": self.reserve, "engine_weights": w, "sync_bucket": self.sync_bucket,
                "engine_kv": self.engine - w, "offloaded_state": early, "offloaded_params": self.host - early}

    @property
    def rollout_trace(self) -> list[tuple[str, float]]:
        """(phase, GiB reached) in the trainer's order from training to generation (launch/plan/memory.py)."""
        return rollout_trace(self._phase_terms())

    @property
    def rollout_peak(self) -> float:
        return max(g for _, g in self.rollout_trace)

    @property
    def rollout_peak_phase(self) -> str:
        """The phase where the rollout peak is reached."""
        return max(self.rollout_trace, key=lambda pg: pg[1])[0]

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per rollout step by phase."""

    generation: float
    old_logprob: float
    update: float
    sync: float
    offload: float = 0.0
    """Moving the offloaded training state to host memory and back (train.offload_*), seconds."""
    grading: float = 0.0
    """Grading the most loaded engine's responses with math-verify (reward.num_workers workers), seconds."""

    @property
    def total(self) -> float:
        return self.generation + self.old_logprob + self.update + self.sync + self.offload + self.grading


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The outcome for one layout: figures, and why it is refused (empty ``reasons`` = fits)."""

    layout: Layout
    world: int
    dp: int
    memory: Memory | None = None
    time: StepTime | None = None
    kv_seqs: int = 0
    """Full-length sequences the engine's KV pool holds at once (per engine)."""
    engines: int = 0
    """Rollout engines the generation time assumes: ``fleet.num_engines`` (1 if the layout has none)."""
    fleet: FleetLayout | None = None
    """The trainer's engine layout for this plan (None when the world does not split into engines)."""
    tail: float = 0.0
    """Longest response per engine batch the generation time assumes, tokens."""
    prompts_per_step: int = 0
    transport: str = ""
    """``rollout.weight_transport`` (vLLM) or ``"in-process"`` (built-in engine)."""
    bucket_mb: float = 0.0
    gpus_per_node: int = 8
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the estimate does not model and how it stands in for it (printed, never a refusal)."""

    @property
    def prompts_per_engine(self) -> int:
        """Prompt groups of the most loaded engine (whole groups of G responses)."""
        return max(self.fleet.shard_sizes(self.prompts_per_step)) if self.fleet else self.prompts_per_step

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def peak_gb(self) -> float:
        """The highest per-GPU memory of the plan, GiB (0 when the layout was refused before memory)."""
        return self.memory.peak if self.memory else 0.0
