"""Colocated or disaggregated on the same GPUs: the planner's comparison of the two placements.

For a job of N GPUs the colocated plan (``plan.estimate``: one pool taking turns, generate -> train ->
sync in sequence) is set beside every disaggregated split the runtime accepts (``launch/plan/disagg.py``):

    R             = engine_tp, 2 engine_tp, ... < N   engine GPUs (rollout.engine_ranks), the rest train;
                                                    splits whose training pool the layout does not
                                                    divide, or whose engines would span nodes, are refused
                                                    by ``PoolLayout`` as at run time
    engine share  rollout.vllm_gpu_memory_utilization = min(0.9, what the engine GPU holds): an engine
                  with a GPU of its own gets vLLM's default share (a config already disaggregated keeps
                  its own)
    staleness     k = max(1, rollout.max_staleness) unless given: the placement only overlaps for k >= 1
                  (k > 0 needs a rollout correction: loss.tis_cap = 2.0 is proposed when none is set)

The best split is the fitting one with the shortest steady-state step at k; disaggregated "beats"
colocated when that step is shorter than the colocated one. Every split is also reported at k = 0
(the sum of the pools' times), where it never does: each phase then runs on fewer GPUs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_maspo.launch.plan.disagg import (
    RELAY_BUCKETS,
    VLLM_DEFAULT_UTILIZATION,
    PoolPlan,
    estimate_disaggregated,
    max_engine_fraction,
)
from megatron_maspo.launch.plan.types import Assumptions, Layout, Plan
from megatron_maspo.rollout import engines

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig
    from megatron_maspo.model.spec import ArchSpec

DEFAULT_TIS_CAP = 2.0
"""The truncated-IS cap proposed when a split needs k >= 1 and the config has no rollout correction
(the value the issue's own acceptance run uses, ``loss.tis_cap=2.0``)."""


def split_engine_fraction(cfg: MaspoConfig, hw: Assumptions) -> float:
    """The vLLM share an engine with a GPU of its own is planned with (module docstring)."""
    ro = cfg.rollout
    if ro.disaggregated:
        return ro.vllm_gpu_memory_utilization
    fits = max_engine_fraction(hw.gpu_mem_gb, buckets_gb=RELAY_BUCKETS * ro.bucket_mb / 1024,
                               reserve_gb=hw.reserve_gb)
    return min(VLLM_DEFAULT_UTILIZATION, fits)


def disaggregated_config(cfg: MaspoConfig, engine_ranks: int, *, staleness: int,
                         engine_fraction: float | None = None) -> MaspoConfig:
    """``cfg`` in the disaggregated placement with ``engine_ranks`` engine GPUs at staleness ``staleness``:
    no offload, no in-run evaluation, a rollout correction when k > 0 needs one.

    Raises:
        ValueError: ``engine_ranks`` is not a multiple of the engine TP (``RolloutConfig``'s own check).
    """
    ro = dataclasses.replace(cfg.rollout, placement="disaggregated", engine_ranks=engine_ranks,
                             max_staleness=staleness, in_flight_updates=False,
                             vllm_gpu_memory_utilization=(cfg.rollout.vllm_gpu_memory_utilization
                                                          if engine_fraction is None else engine_fraction))
    tr = dataclasses.replace(cfg.train, offload_params=False, offload_grads=False, offload_optimizer=False)
    loss = cfg.loss
    if staleness > 0 and not loss.corrects_rollout:
        loss = dataclasses.replace(loss, tis_cap=DEFAULT_TIS_CAP)
    return dataclasses.replace(cfg, rollout=ro, train=tr, loss=loss, eval=dataclasses.replace(cfg.eval, every=0))


def colocated_config(cfg: MaspoConfig) -> MaspoConfig:
    """``cfg`` in the colocated placement (the baseline of a comparison). A disaggregated config's engine
    share is of a GPU of its own, so the baseline takes the colocated default share instead."""
    from megatron_maspo.rollout.config import RolloutConfig

    frac = cfg.rollout.vllm_gpu_memory_utilization
    if cfg.rollout.disaggregated:
        frac = min(frac, RolloutConfig().vllm_gpu_memory_utilization)
    ro = dataclasses.replace(cfg.rollout, placement="colocated", engine_ranks=0, in_flight_updates=False,
                             vllm_gpu_memory_utilization=frac)
    return dataclasses.replace(cfg, rollout=ro)


def split_overrides(old: MaspoConfig, new: MaspoConfig) -> list[str]:
    """``--set`` overrides that turn ``old`` into ``new`` over the fields a split changes."""
    out = []
    for section, names in (("rollout", ("placement", "engine_ranks", "max_staleness", "vllm_gpu_memory_utilization",
                                        "in_flight_updates")),
                           ("train", ("offload_params", "offload_grads", "offload_optimizer")),
                           ("loss", ("tis_cap",)), ("eval", ("every",))):
        for n in names:
            a, b = getattr(getattr(old, section), n), getattr(getattr(new, section), n)
            if a != b:
                out.append(f"{section}.{n}={'null' if b is None else str(b).lower()}")
    return out


def split_candidates(world: int, engine_tp: int) -> list[int]:
    """Engine GPU counts R to try: every multiple of the engine TP that leaves at least one GPU to train."""
    return list(range(engine_tp, world, engine_tp))


@dataclass(frozen=True, kw_only=True)
class PlacementComparison:
    """The colocated plan beside every disaggregated split of the same GPUs."""

    colocated: Plan
    splits: list[tuple[PoolPlan, tuple[str, ...]]] = field(default_factory=list)
    """Every split tried, with the ``--set`` overrides that select it."""
    staleness: int = 1
    in_flight: tuple[PoolPlan, tuple[str, ...]] | None = None
    """The best split again with ``rollout.in_flight_updates`` (the straggler tail overlaps the next batch);
    None where the config cannot run it (routing replay)."""

    @property
    def best(self) -> tuple[PoolPlan, tuple[str, ...]] | None:
        """The fitting split with the shortest step at k (None: none fits)."""
        fitting = [s for s in self.splits if s[0].fits and s[0].time is not None]
        return min(fitting, key=lambda s: s[0].time.total) if fitting else None

    @property
    def speedup(self) -> float | None:
        """Colocated step / best split's step (> 1: disaggregated beats colocated)."""
        best, col = self.best, self.colocated
        if best is None or col.time is None or not col.fits:
            return None
        return col.time.total / best[0].time.total


def compare_placements(cfg: MaspoConfig, spec: ArchSpec, lay: Layout, *, nodes: int, gpus_per_node: int,
                       hw: Assumptions | None = None, staleness: int | None = None) -> PlacementComparison:
    """The colocated plan of ``cfg`` and every disaggregated split of its ``nodes x gpus_per_node`` GPUs."""
    from megatron_maspo.launch.plan.estimator import estimate

    hw = hw or Assumptions()
    k = max(1, cfg.rollout.max_staleness) if staleness is None else staleness
    col = estimate(colocated_config(cfg), spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
    frac = split_engine_fraction(cfg, hw) if engines.reserves_gpu_share(cfg.rollout) else None
    base = colocated_config(cfg)
    splits = []
    for r in split_candidates(nodes * gpus_per_node, cfg.rollout.engine_tp):
        new = disaggregated_config(base, r, staleness=k, engine_fraction=frac)
        plan = estimate_disaggregated(new, spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
        splits.append((plan, tuple(split_overrides(cfg, new))))
    cmp = PlacementComparison(colocated=col, splits=splits, staleness=k)
    best = cmp.best
    if best is None or cfg.model.routing_replay != "off":  # in-flight updates refuse routing replay
        return cmp
    new = disaggregated_config(base, best[0].engine_ranks, staleness=k, engine_fraction=frac)
    new = dataclasses.replace(new, rollout=dataclasses.replace(new.rollout, in_flight_updates=True))
    plan = estimate_disaggregated(new, spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
    return dataclasses.replace(cmp, in_flight=(plan, tuple(split_overrides(cfg, new))))
