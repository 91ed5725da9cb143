"""The disaggregated placement in the planner: a training pool and a rollout pool, one step (pure maths).

With ``rollout.placement=disaggregated`` a job of N GPUs is split into a training pool of T = N - R GPUs
(ranks 0..T-1: the trainer's TP x PP x CP x EP x DP over T) and a rollout pool of R = rollout.engine_ranks
GPUs (R / engine_tp engines), as the runtime's own object, ``rollout/pools.py::PoolLayout``, splits it.
Every phase is the colocated planner's model (``launch/plan/estimator.py``), run on its own pool:

    engine side   generation + grading + apply            R GPUs: plan._generation and _grading_seconds over
                                                          PoolLayout.fleet (the pool's R / engine_tp engines)
                  apply     = sync_fixed_s + W / sync_gb_s   the engine loads the staged sync between two
                              (+ W / host_gb_s for vLLM)     batches: the colocated refit model; vLLM's
                                                             staged copy sits in host memory and goes back
                                                             to the GPU on the way to its workers
    trainer side  old-logprob + update + export + broadcast  T GPUs: plan._trainer_seconds over T
                  rollout.sync_senders=rank0 (the funnel: trainer rank 0 sends everything)
                  export    = W / nvlink_gb_s              gathers and packing on trainer rank 0's node
                              (+ W (pp - 1) / pp / internode_gb_s when its pipeline stages sit on other nodes)
                  broadcast = W (1 / link_gb_s [+ 1 / host_gb_s]) + 3 n_buckets p2p_latency
                  rollout.sync_senders=stages (the transfer plan, ``rollout/transfer_plan.py``: each stage and
                  EP rank sends its own S_i bytes, concurrently, over its own link)
                  export    = S_max / nvlink_gb_s          the TP gather inside each sender's node; no PP
                                                           broadcast, no EP gather
                  broadcast = max(S_max, W) / link_gb_s [+ W / host_gb_s] + 3 n_buckets p2p_latency
                              the slowest link of the plan: a sender's out-link carries S_i, but every engine
                              owner's in-link still carries one whole copy W, so W bounds it from below
    W             = 2 P bytes: the bf16 HF weights, one copy per engine per sync
    link_gb_s     internode_gb_s (40 GB/s: one 400 Gb/s NDR InfiniBand port per GPU, ~80% of its 50 GB/s)
                  when an engine owner sits on another node than rank 0, else nvlink_gb_s; a pipelined
                  NCCL broadcast runs at its slowest link whatever the number of receivers
    [1/host_gb_s] vLLM owners only: the receiver copies each bucket to host memory before it posts the next
                  bucket's broadcast (``rollout/pool_sync.py::WeightReceiver``), so the two run in series

    step          k >= 1:  max(engine side, trainer side)  generation for step s + k overlaps the update of
                                                           step s (``train/rollouts/pool_worker.py``)
                  k = 0:   engine side + trainer side      the engines wait for every update's weights

Memory per GPU (no GPU is shared, so nothing is offloaded: train.offload_* is refused in this placement):

    training GPU  the colocated trainer's categories with no engine: max(train peak, weights + reference +
                  grads + optimizer + reserve + one sync bucket)
    engine GPU    vLLM:    u M (rollout.vllm_gpu_memory_utilization of a GPU of its own) + 3 buckets (one
                           received, two in the relay pool) + reserve; the staged sync, W, in host memory
                  builtin: weights + KV (plan._engine_bytes over R GPUs) + the staged sync W + one bucket
                           + reserve, all on the engine's GPU

The fewest engines (``min_pool_engines``): the step with E' = 1..E engines, each the same engine (memory, KV,
engine TP), the prompts sharded over E' as ``FleetLayout.shard_sizes`` does, the training pool unchanged;
the minimum is the fewest E' within ``POOL_SLACK`` of the full pool's step. For k = 0 every engine counts
(the step is serial); for k >= 1 engines are free until the engine side passes the trainer side.

Not modelled: the batch hand-off from the lead engine to the trainers (one pickled broadcast of the
step's token ids and log-probs over gloo), and any slow-down of decode by the concurrent receive.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_maspo.launch.plan.rollout import cross_node_relay_seconds
from megatron_maspo.launch.plan.types import GIB, Assumptions, Layout, Memory
from megatron_maspo.rollout import engines
from megatron_maspo.rollout.fleet import FleetLayout
from megatron_maspo.rollout.pools import PoolLayout

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig
    from megatron_maspo.model.spec import ArchSpec

VLLM_DEFAULT_UTILIZATION = 0.9
"""vLLM's own ``gpu_memory_utilization`` default (``vllm.EngineArgs``) for an engine with a GPU to itself:
the fraction the planner gives engines when it proposes a split (``launch/plan/split.py``)."""

RELAY_BUCKETS = 3
"""Buckets on a vLLM owner's GPU besides its engine share: one received over the bridge, two in the
double-buffered pool that relays the staged sync to the workers (``VllmEngine.bucket_pool``)."""

POOL_SLACK = 0.10
"""How much longer than the full rollout pool's step the smallest pool's may be (``min_pool_engines``)."""


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """Per-GPU memory of the most loaded engine GPU (the owner's), GiB."""

    share: float
    """The engine itself: vLLM's u x GPU memory (weights + KV + its activations), or the built-in engine's
    weights + KV cache."""
    weights: float
    """The engine's weights inside ``share``."""
    staged: float
    """The staged sync on the GPU (built-in engine), 0 when it is staged in host memory (vLLM)."""
    buckets: float
    """Sync buckets in flight on the owner's GPU."""
    reserve: float
    host: float = 0.0
    """Host memory per owner for the staged sync (vLLM)."""

    @property
    def peak(self) -> float:
        return self.share + self.staged + self.buckets + self.reserve


def max_engine_fraction(gpu_mem_gb: float, *, buckets_gb: float, reserve_gb: float) -> float:
    """The largest ``rollout.vllm_gpu_memory_utilization`` (step 0.01) whose engine GPU fits: what is left
    of ``gpu_mem_gb`` GiB after the relay buckets and the reserve."""
    return math.floor((gpu_mem_gb - buckets_gb - reserve_gb) / gpu_mem_gb * 100) / 100


@dataclass(frozen=True, kw_only=True)
class PoolStepTime:
    """Seconds per step of each pool and the steady-state step they make together."""

    generation: float
    grading: float
    apply: float
    """The engine loading the staged sync between batches."""
    old_logprob: float
    update: float
    export: float
    """The HF export on the training pool feeding the sender (gathers, packing)."""
    broadcast: float
    """Trainer rank 0 -> every engine owner over the ``weights`` bridge."""
    staleness: int
    """k = rollout.max_staleness."""

    @property
    def engine_side(self) -> float:
        """What the rollout pool spends per batch (its busy time, ``rollout/engine_busy_s`` plus the apply)."""
        return self.generation + self.grading + self.apply

    @property
    def trainer_side(self) -> float:
        """What the training pool spends per step: train, then its part of the sync."""
        return self.old_logprob + self.update + self.export + self.broadcast

    @property
    def sync(self) -> float:
        return self.export + self.broadcast

    def total_at(self, k: int) -> float:
        """The steady-state step at staleness ``k``: the pools overlap for k >= 1, take turns for k = 0."""
        return max(self.engine_side, self.trainer_side) if k >= 1 else self.engine_side + self.trainer_side

    @property
    def total(self) -> float:
        return self.total_at(self.staleness)

    @property
    def bound(self) -> str:
        """The pool the other waits for."""
        return "rollout" if self.engine_side >= self.trainer_side else "training"


@dataclass(frozen=True, kw_only=True)
class PoolSize:
    """The fewest engines the rollout pool can run the step with (``min_pool_engines``)."""

    engines: int
    """E: the pool's engines."""
    min_engines: int
    """The fewest E' whose step is within ``slack`` of the full pool's (1 <= E' <= E)."""
    step_s: float
    """The step with all E engines."""
    min_step_s: float
    """The step with ``min_engines``."""
    fewer_step_s: float | None
    """The step with ``min_engines - 1`` (what one engine fewer costs); None when the minimum is 1."""
    fewer_bound: str = ""
    """The pool that bounds the step with one engine fewer ("rollout" or "training")."""
    slack: float = POOL_SLACK


def min_pool_engines(time: PoolStepTime, engines: int, engine_side_at: Callable[[int], tuple[float, float]],
                     *, slack: float = POOL_SLACK) -> PoolSize:
    """The fewest engines of a pool of ``engines`` whose step stays within ``slack`` of the full pool's.

    ``time`` is the full pool's step; ``engine_side_at(e)`` the (generation, grading) seconds of the most
    loaded of ``e`` engines (``estimate_disaggregated``: the same engine, its prompts ``FleetLayout.
    shard_sizes`` over e); the apply and the training pool do not depend on e:

        step(e)   = total_at(k) of ``time`` with generation(e), grading(e)
                    k >= 1: max(generation(e) + grading(e) + apply, trainer side)
                    k = 0:  generation(e) + grading(e) + apply + trainer side
        E_min     = min { e in 1..E : step(e) <= (1 + slack) step(E) }      (E always qualifies: E_min <= E)

    So at k = 0 every engine counts (any growth of the engine side lengthens the serial step), and at
    k >= 1 engines are free until the engine side passes the trainer side (by more than the slack).
    """
    if engines < 1:
        raise ValueError(f"min_pool_engines: engines must be >= 1, got {engines}")
    k = time.staleness

    def at(e: int) -> PoolStepTime:
        if e == engines:
            return time
        gen, grade = engine_side_at(e)
        return dataclasses.replace(time, generation=gen, grading=grade)

    full = time.total_at(k)
    top = full * (1 + slack) + 1e-9
    least = next(e for e in range(1, engines + 1) if at(e).total_at(k) <= top)
    fewer = at(least - 1) if least > 1 else None
    return PoolSize(engines=engines, min_engines=least, step_s=full, min_step_s=at(least).total_at(k),
                    fewer_step_s=fewer.total_at(k) if fewer else None, fewer_bound=fewer.bound if fewer else "",
                    slack=slack)


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """The outcome of one split: both pools' figures, and why it is refused (empty ``reasons`` = fits)."""

    layout: Layout
    world: int
    engine_ranks: int
    dp: int = 0
    pools: PoolLayout | None = None
    memory: Memory | None = None
    """A training GPU (no engine on it)."""
    engine: EngineMemory | None = None
    """The most loaded engine GPU."""
    time: PoolStepTime | None = None
    kv_seqs: int = 0
    """Full-length sequences one engine's KV pool holds at once."""
    tail: float = 0.0
    prompts_per_step: int = 0
    link: str = ""
    """The weights bridge's slowest link ("InfiniBand" or "NVLink") and its GB/s."""
    link_gb_s: float = 0.0
    sender_share: float = 1.0
    """S_max / W: the largest share of one sync a trainer rank sends (``rollout.sync_senders``)."""
    engine_fraction_max: float | None = None
    """The largest rollout.vllm_gpu_memory_utilization the engine GPU holds (vLLM only)."""
    engine_kind: str = "vllm"
    gpus_per_node: int = 8
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the estimate does not model (``estimator.py::FP8_TRAINING_NOTE``); printed, never a refusal."""
    pool_size: PoolSize | None = None
    """The fewest engines the step runs with (``min_pool_engines``); only for a plan that fits."""

    @property
    def min_engines(self) -> int:
        """The fewest engines within ``POOL_SLACK`` of this pool's step; 0 when the plan does not fit."""
        return self.pool_size.min_engines if self.pool_size else 0

    @property
    def min_engines_step_s(self) -> float:
        """The step with ``min_engines`` engines; 0.0 when the plan does not fit."""
        return self.pool_size.min_step_s if self.pool_size else 0.0

    @property
    def trainer_world(self) -> int:
        return self.world - self.engine_ranks

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def peak_gb(self) -> float:
        """The higher of a training GPU's and an engine GPU's peak, GiB."""
        return max(self.memory.peak if self.memory else 0.0, self.engine.peak if self.engine else 0.0)


def bridge_link_gb_s(pools: PoolLayout, gpus_per_node: int, hw: Assumptions) -> tuple[str, float]:
    """The weights bridge's slowest link: InfiniBand when an engine owner sits off trainer rank 0's node."""
    if any(r // gpus_per_node != 0 for r in pools.owner_ranks):
        return "InfiniBand", hw.internode_gb_s
    return "NVLink", hw.nvlink_gb_s


def broadcast_seconds(weight_bytes: float, buckets: int, *, link_gb_s: float, host_gb_s: float | None,
                      latency_s: float) -> float:
    """Seconds of one sync's broadcast (module docstring): ``weight_bytes`` over the link, in series with
    the receivers' copies to host memory when ``host_gb_s`` is given; three messages per bucket."""
    per_byte = 1 / (link_gb_s * 1e9) + (1 / (host_gb_s * 1e9) if host_gb_s else 0.0)
    return weight_bytes * per_byte + 3 * buckets * latency_s


def export_seconds(weight_bytes: float, *, pp: int, trainer_world: int, gpus_per_node: int,
                   hw: Assumptions) -> float:
    """Seconds of the export into the sender: on its node at NVLink speed, plus the share of the layers
    held by pipeline stages on other nodes over the inter-node link (stage s of replica 0 is rank s T / pp)."""
    off_node = sum(1 for s in range(1, pp) if (s * trainer_world // pp) // gpus_per_node != 0)
    return weight_bytes / (hw.nvlink_gb_s * 1e9) + weight_bytes * off_node / pp / (hw.internode_gb_s * 1e9)


def sender_share(spec: ArchSpec, pools: PoolLayout) -> float:
    """``S_max / W``: the largest share of a sync one trainer rank sends under ``pools.sync_senders``."""
    plan = _plan(spec, pools.trainer_layout, pools.owner_ranks, pools.sync_senders)
    return plan.sender_bytes_max / max(plan.bytes_total, 1)


_PLANS: dict[tuple, object] = {}


def _plan(spec, layout, owners, senders):
    """The transfer plan, cached: the split search asks for the same few (ArchSpec is not hashable: its repr)."""
    from megatron_maspo.rollout.transfer_plan import build_plan

    key = (repr(spec), layout, owners, senders)
    if key not in _PLANS:
        if len(_PLANS) > 64:
            _PLANS.clear()
        _PLANS[key] = build_plan(spec, layout, owners, dtype="bfloat16", senders=senders)
    return _PLANS[key]


def apply_seconds(weight_bytes: float, *, hw: Assumptions, host_staged: bool) -> float:
    """Seconds the engine spends loading a staged sync: the colocated refit model (``sync_fixed_s`` +
    W / ``sync_gb_s``), plus the copy back from host memory when the sync was staged there."""
    back = weight_bytes / (hw.host_gb_s * 1e9) if host_staged else 0.0
    return hw.sync_fixed_s + weight_bytes / (hw.sync_gb_s * 1e9) + back


def pool_layout(lay: Layout, world: int, engine_ranks: int, engine_tp: int,
                gpus_per_node: int, *, sync_senders: str = "stages",
                moe: bool = False) -> tuple[PoolLayout | None, list[str]]:
    """The runtime's :class:`PoolLayout` for this split and its placement, or None and why not."""
    try:
        pools = PoolLayout(world=world, engine_ranks=engine_ranks, rollout_tp=engine_tp, tp=lay.tp, pp=lay.pp,
                           cp=lay.cp, ep=lay.ep, pp_first=lay.pp_first, pp_last=lay.pp_last,
                           sync_senders=sync_senders, moe=moe and lay.ep > 1)
        pools.placement(gpus_per_node)
    except ValueError as e:
        return None, [str(e)]
    return pools, []


def engine_memory(cfg: MaspoConfig, engine_share: float, engine_w: float, weight_bytes: float,
                  hw: Assumptions) -> EngineMemory:
    """The owner GPU's memory (bytes in, GiB out) for the engine share ``plan._engine_bytes`` gives."""
    bucket = cfg.rollout.bucket_mb * 2**20
    if engines.relays_to_workers(cfg.rollout):  # staged on the host, relayed bucket by bucket
        return EngineMemory(share=engine_share / GIB, weights=engine_w / GIB, staged=0.0,
                            buckets=RELAY_BUCKETS * bucket / GIB, reserve=hw.reserve_gb, host=weight_bytes / GIB)
    return EngineMemory(share=engine_share / GIB, weights=engine_w / GIB, staged=weight_bytes / GIB,
                        buckets=bucket / GIB, reserve=hw.reserve_gb)


def _pool_memory_reasons(mem: Memory, eng: EngineMemory, kv_seqs: int, seq_max: int, kv_pool: float,
                         hw: Assumptions) -> list[str]:
    out = []
    if mem.peak > hw.gpu_mem_gb:
        out.append(f"needs {mem.peak:.1f} GiB per training GPU > {hw.gpu_mem_gb:.0f} GiB (train peak "
                   f"{mem.train_peak:.1f}, sync {mem.rollout_peak:.1f})")
    if eng.peak > hw.gpu_mem_gb:
        out.append(f"needs {eng.peak:.1f} GiB per engine GPU > {hw.gpu_mem_gb:.0f} GiB (engine {eng.share:.1f}, "
                   f"staged sync {eng.staged:.1f}, buckets {eng.buckets:.1f}, reserve {eng.reserve:.1f})")
    if kv_seqs < 1:
        out.append(f"the engine's KV pool ({kv_pool / GIB:.1f} GiB) holds no full-length sequence of {seq_max} "
                   "tokens; raise rollout.vllm_gpu_memory_utilization (its GPU is its own) or vllm_tp")
    return out


def estimate_disaggregated(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, *, nodes: int, gpus_per_node: int,
                           hw: Assumptions | None = None) -> PoolPlan:
    """Memory and time of ``cfg``'s disaggregated split (``rollout.engine_ranks``) on ``nodes x
    gpus_per_node`` GPUs, the training pool in layout ``lay``; ``reasons`` lists what it violates."""
    import megatron_maspo.launch.plan.estimator as P

    hw = hw or Assumptions()
    ro = cfg.rollout
    world, r = nodes * gpus_per_node, ro.engine_ranks
    base = PoolPlan(layout=lay, world=world, engine_ranks=r, prompts_per_step=cfg.train.prompts_per_step,
                    gpus_per_node=gpus_per_node, engine_kind=ro.engine,
                    notes=[P.FP8_TRAINING_NOTE] if P.fp8_training_requested(cfg) else [])
    pools, reasons = pool_layout(lay, world, r, ro.engine_tp, gpus_per_node, sync_senders=ro.sync_senders,
                                 moe=spec.is_moe)
    if pools is None:
        return dataclasses.replace(base, reasons=reasons)
    t = pools.trainer_world
    reasons, dp = P._layout_reasons(cfg, spec, lay, t, gpus_per_node)
    if not dp:
        return dataclasses.replace(base, pools=pools, reasons=reasons)
    tr = cfg.train
    if tr.offload_params or tr.offload_grads or tr.offload_optimizer:
        reasons.append("train.offload_* frees GPU memory for a colocated engine; with rollout.placement="
                       "disaggregated the engines have GPUs of their own: turn it off")
    sh = P._shape(cfg, spec, lay, dp, hw, reasons)
    share, engine_w, kv_pool = P._engine_bytes(cfg, spec, lay, sh, r, hw)
    mem, _ = P._memory(cfg, spec, lay, dp, sh, 0.0, 0.0, hw)  # no engine on a training GPU
    w_bytes = 2 * spec.num_parameters()
    eng = engine_memory(cfg, share, engine_w, w_bytes, hw)
    kv_seqs = int(max(0.0, kv_pool) // P.cache_bytes_per_sequence(spec, lay.vllm_tp, sh.seq_max))
    reasons += _pool_memory_reasons(mem, eng, kv_seqs, sh.seq_max, kv_pool, hw)
    old_lp, update = P._trainer_seconds(cfg, spec, lay, sh, t, hw, gpus_per_node)
    fleet = pools.fleet
    link, link_gb_s = bridge_link_gb_s(pools, gpus_per_node, hw)
    n_buckets = math.ceil(w_bytes / (ro.bucket_mb * 2**20))
    host = hw.host_gb_s if engines.relays_to_workers(ro) else None
    share = sender_share(spec, pools)
    if ro.sync_senders == "stages":
        top = w_bytes * share  # S_max
        export = top / (hw.nvlink_gb_s * 1e9)
        broadcast = broadcast_seconds(max(top, w_bytes), n_buckets, link_gb_s=link_gb_s, host_gb_s=host,
                                      latency_s=hw.p2p_latency_us * 1e-6)
    else:
        export = export_seconds(w_bytes, pp=lay.pp, trainer_world=t, gpus_per_node=gpus_per_node, hw=hw)
        broadcast = broadcast_seconds(w_bytes, n_buckets, link_gb_s=link_gb_s, host_gb_s=host,
                                      latency_s=hw.p2p_latency_us * 1e-6)
    time = PoolStepTime(generation=P._generation(cfg, spec, lay, sh, fleet, engine_w, kv_pool, hw, gpus_per_node),
                        grading=P._grading_seconds(cfg, fleet, sh.n_seqs, hw),
                        apply=apply_seconds(w_bytes, hw=hw, host_staged=host is not None)
                        + cross_node_relay_seconds(w_bytes, vllm_tp=lay.vllm_tp, gpus_per_node=gpus_per_node,
                                                   internode_gb_s=hw.internode_gb_s),
                        old_logprob=old_lp, update=update,
                        export=export, broadcast=broadcast,
                        staleness=ro.max_staleness)
    frac = (max_engine_fraction(hw.gpu_mem_gb, buckets_gb=eng.buckets, reserve_gb=hw.reserve_gb)
            if engines.reserves_gpu_share(ro) else None)
    size = None if reasons else min_pool_engines(
        time, pools.num_engines, _engine_side_at(cfg, spec, lay, sh, engine_w, kv_pool, hw, gpus_per_node,
                                                 fleet.rollout_tp))
    return dataclasses.replace(base, dp=dp, pools=pools, memory=mem, engine=eng, time=time, kv_seqs=kv_seqs,
                               tail=sh.tail, link=link, link_gb_s=link_gb_s, sender_share=share,
                               engine_fraction_max=frac, pool_size=size,
                               reasons=reasons)


def _engine_side_at(cfg, spec, lay, sh, engine_w, kv_pool, hw, gpus_per_node, engine_tp):
    """(generation, grading) of the most loaded of e engines of TP ``engine_tp``, each the pool's engine
    (weights ``engine_w``, KV pool ``kv_pool``): the colocated models on ``FleetLayout(e engine_tp)``,
    cached by the largest shard (the only thing e changes)."""
    import megatron_maspo.launch.plan.estimator as P

    seen: dict[int, tuple[float, float]] = {}

    def at(e: int) -> tuple[float, float]:
        fleet = FleetLayout(world=e * engine_tp, rollout_tp=engine_tp)
        key = max(fleet.shard_sizes(cfg.train.prompts_per_step))
        if key not in seen:
            seen[key] = (P._generation(cfg, spec, lay, sh, fleet, engine_w, kv_pool, hw, gpus_per_node),
                         P._grading_seconds(cfg, fleet, sh.n_seqs, hw))
        return seen[key]

    return at


# --- memory verdicts for this placement (launch/plan/verdict.py runs them) --------------------------------

def _engine_share_fits(cfg, lay, plan, hw):
    """The engine GPU over its memory: the largest vLLM share it holds."""
    if not engines.reserves_gpu_share(cfg.rollout) or plan.engine is None or plan.engine.peak <= hw.gpu_mem_gb:
        return None
    frac = plan.engine_fraction_max
    if frac is None or frac <= 0.05 or frac >= cfg.rollout.vllm_gpu_memory_utilization:
        return None
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm_gpu_memory_utilization=frac)), lay


def _pool_changes():
    from megatron_maspo.launch.plan.verdict import CHANGES

    kept = tuple((n, c) for n, c in CHANGES if n in ("recompute", "pp x 2", "tp x 2"))
    return (*kept, ("a smaller engine share", _engine_share_fits))


POOL_CHANGES = _pool_changes()
"""The verdict changes of this placement: no offload (nothing shares a GPU), the engine share of its own
GPU, and the trainer's recompute / pp x 2 / tp x 2 on the training pool."""
