"""What makes a layout that does not fit in GPU memory fit, and what it costs (``maspo plan``).

A memory refusal alone does not say whether the layout is close (published runs often run such layouts
with the trainer's state offloaded during generation) or hopeless. For a plan refused on memory only,
each single change below is planned again with the same estimate, and so is each pair:

    offload     train.offload_params/grads/optimizer=true    costs the copies out and back (host_gb_s)
    recompute   model.recompute=full                         costs one more forward in the update
    engine      a lower rollout.vllm_gpu_memory_utilization  costs generation time (smaller KV pool)
    pp x 2      parallel.pp doubled                          costs what the estimate says (fewer DP ranks)
    tp x 2      parallel.tp doubled (within a node)          the same

A change "makes the layout fit" when the new plan has no reasons left; `maspo plan` prints every such
change, cheapest first (a pair only when neither half fits alone), with its margin,
GPU memory minus the new peak: "fits with offload, by 6.3 GiB, +9.1 s per step".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_maspo.rollout import engines

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig
    from megatron_maspo.launch.plan.types import Assumptions, Layout, Plan
    from megatron_maspo.model.spec import ArchSpec

Change = Callable[["MaspoConfig", "Layout", "Plan", "Assumptions"], "tuple[MaspoConfig, Layout] | None"]


@dataclass(frozen=True)
class Verdict:
    """The cheapest change that makes a refused layout fit."""

    change: str
    """What to change, in words (``"offload"``, ``"offload + recompute"``, ...)."""
    overrides: tuple[str, ...]
    """``--set`` overrides that apply it."""
    margin_gb: float
    """GPU memory left at the new peak, GiB."""
    cost_s: float
    """Seconds the change adds to a step (negative: it also speeds the step up)."""
    plan: Plan

    def describe(self) -> str:
        return (f"fits with {self.change}, by {self.margin_gb:.1f} GiB (peak {self.plan.peak_gb:.1f} GiB), "
                f"{self.cost_s:+.1f} s per step: " + " ".join(f"--set {o}" for o in self.overrides))


def _offload(cfg, lay, plan, hw):
    tr = cfg.train
    if tr.offload_params and tr.offload_grads and tr.offload_optimizer:
        return None
    t = dataclasses.replace(tr, offload_params=True, offload_grads=True, offload_optimizer=True)
    return dataclasses.replace(cfg, train=t), lay


def _recompute(cfg, lay, plan, hw):
    if lay.recompute == "full":
        return None
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="full")), \
        dataclasses.replace(lay, recompute="full")


def _engine_fraction(cfg, lay, plan, hw):
    """The largest engine share (in steps of 0.01) that brings the rollout peak under the GPU's memory."""
    ro, m = cfg.rollout, plan.memory
    if not engines.reserves_gpu_share(ro) or m is None:
        return None
    over = m.rollout_peak - hw.gpu_mem_gb
    if over <= 0:
        return None
    frac = int((ro.vllm_gpu_memory_utilization - over / hw.gpu_mem_gb) * 100) / 100
    if frac <= 0.05:
        return None
    return dataclasses.replace(cfg, rollout=dataclasses.replace(ro, vllm_gpu_memory_utilization=frac)), lay


def _double(field: str) -> Change:
    def change(cfg, lay, plan, hw):
        new = dataclasses.replace(lay, **{field: getattr(lay, field) * 2})
        par = dataclasses.replace(cfg.parallel, **{field: getattr(new, field)})
        return dataclasses.replace(cfg, parallel=par), new
    return change


CHANGES: tuple[tuple[str, Change], ...] = (
    ("offload", _offload), ("recompute", _recompute), ("a smaller engine share", _engine_fraction),
    ("pp x 2", _double("pp")), ("tp x 2", _double("tp")),
)
"""The changes tried, singly and in pairs, in the order a tie is broken."""


def memory_verdicts(cfg: MaspoConfig, spec: ArchSpec, plan: Plan, *, nodes: int, gpus_per_node: int,
                    hw: Assumptions, estimator: Callable | None = None,
                    changes: tuple[tuple[str, Change], ...] = CHANGES) -> list[Verdict]:
    """Every single change and pair of ``changes`` that makes ``plan`` fit, cheapest first (a pair
    only when neither of its changes fits alone); empty when none does or ``plan`` is refused for more
    than memory. ``estimator`` plans each changed config (default ``plan.estimate``, the colocated
    placement; ``disagg.estimate_disaggregated`` with ``disagg.POOL_CHANGES`` for the other)."""
    from megatron_maspo.launch.plan.estimator import apply_layout, estimate, layout_of

    estimator = estimator or estimate
    if plan.memory is None or plan.time is None or plan.fits or not _memory_only(plan):
        return []
    found: list[Verdict] = []
    combos = [(c,) for c in changes] + list(itertools.combinations(changes, 2))
    for combo in combos:
        try:  # a change the config's own validation refuses (tp x pp past the world) is no verdict
            got = _apply(combo, cfg, plan, hw)
            new = estimator(got[0], spec, got[1], nodes=nodes, gpus_per_node=gpus_per_node, hw=hw) if got else None
        except ValueError:
            continue
        if new is None or not new.fits or new.time is None or new.memory is None:
            continue
        singles = {v.change for v in found}
        if len(combo) == 2 and (combo[0][0] in singles or combo[1][0] in singles):
            continue
        c, lay = got
        overrides = tuple(_cfg_overrides(cfg, c)) + tuple(apply_layout(cfg, lay) if lay != layout_of(cfg) else ())
        found.append(Verdict(" + ".join(n for n, _ in combo), tuple(dict.fromkeys(overrides)),
                             hw.gpu_mem_gb - new.peak_gb, new.time.total - plan.time.total, new))
    return sorted(found, key=lambda v: (v.cost_s, v.change.count("+")))


def _apply(combo, cfg, plan, hw):
    """``cfg`` and layout with every change of ``combo`` applied; None when one does not apply."""
    c, lay = cfg, plan.layout
    for _, change in combo:
        got = change(c, lay, plan, hw)
        if got is None:
            return None
        c, lay = got
    return c, lay


def _memory_only(plan: Plan) -> bool:
    """Whether every reason of ``plan`` is a memory one (the peak or the KV pool)."""
    return all(r.startswith(("needs ", "the engine's KV pool")) for r in plan.reasons) \
        and any(r.startswith("needs ") for r in plan.reasons)


def _cfg_overrides(old: MaspoConfig, new: MaspoConfig) -> list[str]:
    """``--set`` overrides for the train / rollout fields a change touched."""
    out = []
    for section, names in (("train", ("offload_params", "offload_grads", "offload_optimizer")),
                           ("rollout", ("vllm_gpu_memory_utilization",))):
        for n in names:
            a, b = getattr(getattr(old, section), n), getattr(getattr(new, section), n)
            if a != b:
                out.append(f"{section}.{n}={str(b).lower()}")
    return out
