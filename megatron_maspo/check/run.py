"""``maspo check``: a recipe's first cluster run, down to every shape, on this machine in seconds.

For a config on ``nodes x gpus_per_node`` GPUs it builds the real Megatron-Core model of every distinct
model-parallel rank on the meta device (``check/world.py``: fake process groups, no memory, options the
trainer builds, ``use_cpu_initialization=False``) and runs every step that needs shapes but not numbers
(``check/steps.py``), in this order, stopping at the first mismatch:

    layout        the distinct (tp, pp, ep, cp) coordinates of the world
    tables        conversion tables vs each rank's parameter names and shapes, both ways, under the local
                  spec's names and the TE spec's recorded names (``model/te_names.py``)
    checkpoint    the sharded-state-dict keys of all ranks tile every tensor once
    weight sync   one pipeline stage owns each layer, the embedding and the head (the export's per-stage
                  manifest); the export manifest laid into ``rollout.bucket_mb`` buckets as the sync packs it
    placement     each engine's node and GPUs (``FleetLayout.placement``); no GPU shared
    process groups
                  each pool's default group and the bridges between pools with the backend each gets on
                  GPUs (``parallel/group_plan.py``): a group carrying device tensors must be nccl
    transfer plan, weight links (disaggregated)
                  who sends which tensors; the communicators each rank joins between the pools (NCCL and
                  gloo, from ``PoolLayout.bridge_comms``, the list the bridges are built from) and their
                  NCCL buffers against ``rollout.weight_link_nccl_budget_mb`` (``parallel/link_budget.py``)
    host shared memory
                  the ``/dev/shm`` per node a vLLM engine of the rollout pool stages syncs into (about two
                  syncs of the model in the engine dtype per engine owner; ``rollout/shm_budget.py``)
    memory plan   the planner's parameters per GPU and offload bytes vs the built ranks'; the plan fits
    rollout pool (disaggregated)
                  printed only: the fewest engines whose step stays within 10 % of the full pool's
                  (``launch/plan/disagg.py::min_pool_engines``)

With ``rollout.placement=disaggregated`` the job is split as it runs (``rollout/pools.py::PoolLayout``):
the layout must divide the training pool's T = world - rollout.engine_ranks ranks, whose model ranks are the
ones built; the engines' placement is ``PoolLayout.placement`` (no engine spans nodes, none shares a GPU
with another or with the training pool); the memory plan is ``launch/plan/disagg.py``'s, with the
training GPU's peak the trainer's own (no engine on it) and the engine GPU's the engine's own.

The Transformer Engine spec cannot be built here: for ``model.attention_backend='te'`` the ranks are built
with the local spec and their names renamed to the TE spec's (grouped-GEMM experts included), which is
what the trainer's TE build names them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_maspo.check.pools import check_process_groups, check_weight_links, shm_line
from megatron_maspo.check.ranks import build_options, check_all_ranks
from megatron_maspo.check.steps import (
    CheckError,
    check_bucket_plan,
    check_checkpoint_cover,
    check_memory,
    check_placement,
    check_pool_placement,
    check_stage_manifest,
    export_manifest,
)
from megatron_maspo.check.world import coordinates
from megatron_maspo.parallel.group_plan import plan_groups
from megatron_maspo.rollout.buckets import dtype_size

GPUS_PER_NODE = 8
"""The recipes' documented node size (``recipes/base.py``)."""


@dataclass
class CheckResult:
    """What a check found: ``error`` is None when every step passed; ``lines`` is the printed report."""

    lines: list[str] = field(default_factory=list)
    error: CheckError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def documented_layout(cfg) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` a recipe documents: its ``parallel.world_size`` on 8-GPU nodes (one
    smaller node for a world below 8)."""
    world = cfg.parallel.world_size
    g = min(GPUS_PER_NODE, world)
    return max(1, world // g), g


def check_config(cfg, *, nodes: int, gpus_per_node: int, gpu_mem_gb: float | None = None,
                 node_shm_gb: float | None = None, echo: Callable[[str], None] | None = None,
                 jobs: int | None = None) -> CheckResult:
    """Run every step for ``cfg`` on ``nodes x gpus_per_node`` GPUs; see the module docstring.

    ``node_shm_gb``: ``/dev/shm`` a node offers, checked against the rollout pool's staging (None: printed only).
    ``gpu_mem_gb``: GPU memory for the memory plan; None: that of ``cfg.parallel.gpu``.
    ``jobs``: worker processes for the ranks' builds (``check/ranks.py``); None: this machine's cores.
    """
    res = CheckResult()

    def say(line: str) -> None:
        res.lines.append(line)
        if echo is not None:
            echo(line)

    try:
        _run(cfg, nodes, gpus_per_node, gpu_mem_gb, node_shm_gb, say, jobs)
    except CheckError as e:
        res.error = e
        say(f"FAIL {e}")
    return res


def _run(cfg, nodes: int, gpus_per_node: int, gpu_mem_gb: float | None, node_shm_gb: float | None,
         say: Callable[[str], None], jobs: int | None = None) -> None:
    from megatron_maspo.launch.plan.estimator import arch_of, estimate, layout_of
    from megatron_maspo.launch.plan.model import local_params
    from megatron_maspo.launch.plan.types import gpu_assumptions
    from megatron_maspo.rollout.fleet import build_fleet
    from megatron_maspo.rollout.weight_sync import bucket_bytes_from_mb

    world = nodes * gpus_per_node
    p = cfg.parallel
    pools = None
    try:  # the config validates the layout against the world (as the launcher sets world_size)
        if cfg.rollout.disaggregated:  # Megatron's world is the training pool (train/loop.py)
            from megatron_maspo.rollout.pools import build_pools

            pools = build_pools(p, cfg.rollout, world)
        trainers = pools.trainer_world if pools else world
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(p, world_size=trainers))
        coords = coordinates(trainers, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)
    except ValueError as e:
        r = cfg.rollout.engine_ranks
        pool = f" ({world - r} training + {r} engine GPUs)" if cfg.rollout.disaggregated else ""
        raise CheckError("layout", f"{nodes} x {gpus_per_node} GPUs{pool}: {e}") from None
    spec = arch_of(cfg)
    t0 = time.perf_counter()
    _, te, grouped = build_options(cfg, spec)
    say(f"model: {cfg.model.arch or cfg.model.source} ({spec.num_parameters() / 1e9:.2f} B parameters), "
        f"{'TE (recorded names)' if te else 'local'} spec, on {nodes} x {gpus_per_node} GPUs: tp={p.tp} "
        f"pp={p.pp} ep={p.ep} cp={p.cp}, {len(coords)} distinct model-parallel ranks"
        + (f" in the training pool of {trainers} GPUs ({world - trainers} engine GPUs)" if pools else ""))
    built = check_all_ranks(cfg, spec, coords, trainers, jobs=jobs)
    n_local, n_te, counts, shards, stages = built.n_local, built.n_te, built.counts, built.shards, built.stages
    grouped_note = f" (TE experts: grouped GEMM {'on' if grouped else 'off'})" if spec.is_moe else ""
    names = (f"{n_te} TE-spec names" if te else f"{n_local} local-spec names, {n_te} TE-spec names") + grouped_note
    say(f"ok   tables: {names} resolve both ways with the shapes the HF tensors imply "
        f"({time.perf_counter() - t0:.1f} s to build {len(coords)} ranks on the meta device)")
    keys = check_checkpoint_cover(shards)
    say(f"ok   checkpoint: {keys} sharded-state-dict keys, every one tiled exactly once by the ranks' shards")
    check_stage_manifest(stages, spec.num_layers)
    dtype = "bfloat16" if cfg.model.bf16 else "float32"
    manifest = export_manifest(spec, dtype)
    cap = bucket_bytes_from_mb(cfg.rollout.bucket_mb)
    n_buckets, largest = check_bucket_plan(manifest, cap)
    big = max(manifest, key=lambda m: m[2][0] * (m[2][1] if len(m[2]) > 1 else 1))
    say(f"ok   weight sync: {len(stages)} stage(s) own every layer once; {len(manifest)} tensors ({dtype}) in {n_buckets} buckets of {cfg.rollout.bucket_mb:g} MiB; "
        f"largest {big[0]} {big[2]} = {largest / 2**20:,.0f} MiB"
        + (f", split over {-(-largest // cap)} buckets" if largest > cap else ""))
    if pools is None:
        fleet = build_fleet(cfg.parallel, cfg.rollout, world)
        placed = check_placement(fleet, nodes, gpus_per_node)
        first = min(e.node for e in placed)
        tail = "; no GPU shared"
    else:
        placed = check_pool_placement(pools, nodes, gpus_per_node)
        first = placed[0].node
        tail = (f"; ranks {pools.trainer_world}-{world - 1}, no GPU shared with another engine or the training "
                f"pool's {pools.trainer_world}")
    per_node: dict[int, list] = {}
    for e in placed:
        per_node.setdefault(e.node, []).append(e.gpus)
    span = (f", each on {placed[0].nodes} whole nodes (leaders: ranks {', '.join(map(str, placed[0].leaders))}"
            f"{', ...' if len(placed) > 1 else ''})" if placed[0].nodes > 1 else "")
    say(f"ok   engine placement: {len(placed)} {cfg.rollout.engine} engines (rollout TP {placed[0].tp}){span}, "
        f"node {first}: "
        + " ".join("[" + ",".join(map(str, g)) + "]" for g in per_node.get(first, [])) + tail)
    say(check_process_groups(plan_groups(pools if pools is not None else world, gpus_per_node)))
    if pools is not None:
        from megatron_maspo.check.pools import check_transfer_plan
        from megatron_maspo.rollout.transfer_plan import build_plan

        say(check_transfer_plan(build_plan(spec, pools.trainer_layout, pools.owner_ranks, dtype=dtype,
                                           senders=cfg.rollout.sync_senders), spec))
        say(check_weight_links(pools, cfg.rollout, gpus_per_node))
    sync_bytes = sum(math.prod(shape) * dtype_size(dt) for _, dt, shape in manifest)
    say(shm_line(cfg.rollout, sync_bytes, [e.node for e in placed], dtype, node_shm_gb=node_shm_gb))
    lay = layout_of(cfg)
    # the GPU the recipe is sized for (parallel.gpu); --gpu-mem-gb overrides its memory
    hw = gpu_assumptions(cfg.parallel.gpu, **({} if gpu_mem_gb is None else {"gpu_mem_gb": gpu_mem_gb}))
    if pools is None:
        plan = estimate(cfg, spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
    else:
        from megatron_maspo.launch.plan.disagg import estimate_disaggregated

        plan = estimate_disaggregated(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                                            world_size=world)),
                                      spec, lay, nodes=nodes, gpus_per_node=gpus_per_node, hw=hw)
    planned = local_params(spec, lay, cfg.model.make_vocab_size_divisible_by)
    off = check_memory(plan, counts, planned, cfg)
    worst = max(counts, key=lambda k: k.dense + k.expert)
    peak = (f"peak {plan.memory.peak:.1f} of {hw.gpu_mem_gb:g} GiB" if pools is None else
            f"peak per training GPU {plan.memory.peak:.1f} (the trainer's own: no engine on it), per engine GPU "
            f"{plan.engine.peak:.1f} (the engine's own) of {hw.gpu_mem_gb:g} GiB")
    say(f"ok   memory plan: largest rank {worst.dense + worst.expert:,} parameters = the planner's; {peak}; "
        "offloaded per GPU " + (", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in off.items() if v) or "nothing"))
    if pools is not None and plan.pool_size is not None:
        from megatron_maspo.launch.plan.report import format_pool_size

        say(f"ok   {format_pool_size(plan.pool_size)}")

