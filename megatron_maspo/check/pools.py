"""``maspo check`` steps about how the job's processes talk, from the layout alone (no model needed).

* :func:`check_process_groups`: every process group the job makes on GPUs with the backend it gets
  (``parallel/group_plan.py``); fails when a group that carries device tensors would be gloo.
* :func:`check_transfer_plan`: the disaggregated weight transfer's plan (``rollout/transfer_plan.py``): its
  senders, bytes per sender and largest link; fails when it leaves an engine tensor uncovered.
* :func:`shm_line`: the host shared memory a vLLM engine of the rollout pool stages syncs into
  (``rollout/shm_budget.py``), per node; fails only against a node size the caller gives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from megatron_maspo.check.steps import CheckError
from megatron_maspo.parallel.group_plan import GroupPlan, GroupPlanError, format_ranks, validate
from megatron_maspo.rollout.shm_budget import STAGED_SYNCS, shm_fix, staging_bytes, uses_shm

POOLS = ("world", "train", "rollout")


def check_process_groups(plans: Sequence[GroupPlan]) -> str:
    """The ``process groups`` line for ``plans`` (``group_plan.plan_groups``) once they pass ``validate``.

    Raises:
        CheckError: a group carries device tensors but would be gloo on GPUs (the step, group and ranks).
    """
    try:
        validate(plans)
    except GroupPlanError as e:
        raise CheckError("process groups", str(e)) from None
    pools = [p for p in plans if p.name in POOLS]
    bridges = [p for p in plans if p.name not in POOLS]
    line = "ok   process groups: " + ", ".join(f"{p.name} pool ({format_ranks(p.ranks)}) {p.backend}" for p in pools)
    line += ("; bridges " + ", ".join(p.describe() for p in bridges)) if bridges else " (colocated: no bridges)"
    return line + "; backends on GPUs, none depends on a pool's size"


def node_need(sync_bytes: int, owner_nodes: Sequence[int], dtype: str) -> tuple[int, str]:
    """``(bytes, figure)``: ``/dev/shm`` the busiest node needs for its engine owners' staged syncs."""
    node, owners = Counter(owner_nodes).most_common(1)[0]
    need = staging_bytes(sync_bytes, owners)
    return need, (f"{need / 2**30:,.1f} GiB of /dev/shm per node (node {node}: {owners} vLLM engine owner(s) x "
                  f"{STAGED_SYNCS} syncs x {sync_bytes / 2**30:,.1f} GiB {dtype})")


def shm_line(rollout, sync_bytes: int, owner_nodes: Sequence[int], dtype: str, *,
             node_shm_gb: float | None = None) -> str:
    """The ``host shared memory`` line: ``/dev/shm`` per node for the rollout pool's staged syncs.

    Args:
        rollout: the config's ``rollout`` section.
        sync_bytes: one sync's bytes (the export manifest in the engine dtype).
        owner_nodes: the node of each engine owner (``PoolLayout.placement``).
        dtype: the engine dtype, for the line.
        node_shm_gb: ``/dev/shm`` a node offers (GiB); None = print the need only.

    Raises:
        CheckError: ``node_shm_gb`` is given and below the busiest node's need.
    """
    if not uses_shm(rollout):
        why = ("colocated: the engines take buckets in process or by CUDA IPC" if not rollout.disaggregated else
               f"rollout.engine={rollout.engine}, weight_transport={rollout.weight_transport}: no shared staging")
        return f"ok   host shared memory: not used ({why})"
    need, figure = node_need(sync_bytes, owner_nodes, dtype)
    if node_shm_gb is not None and node_shm_gb * 2**30 < need:
        raise CheckError("host shared memory", f"{figure} > the node's {node_shm_gb:g} GiB: {shm_fix(need)}")
    return f"ok   host shared memory: {figure}; Docker's default is 64 MB: {shm_fix(need)}"


def staging_need(cfg, nodes: int, gpus_per_node: int) -> tuple[int, str] | None:
    """``(bytes, figure)`` the busiest node of ``cfg``'s layout needs in ``/dev/shm``, None when its engines
    stage nothing there (``maspo doctor`` compares it with this machine's free ``/dev/shm``)."""
    import math

    from megatron_maspo.check.steps import export_manifest
    from megatron_maspo.launch.plan.estimator import arch_of
    from megatron_maspo.rollout.buckets import dtype_size
    from megatron_maspo.rollout.pools import build_pools

    if not uses_shm(cfg.rollout):
        return None
    pools = build_pools(cfg.parallel, cfg.rollout, nodes * gpus_per_node)
    dtype = "bfloat16" if cfg.model.bf16 else "float32"  # the engine dtype, as the check's weight-sync step
    sync = sum(math.prod(shape) * dtype_size(dt) for _, dt, shape in export_manifest(arch_of(cfg), dtype))
    return node_need(sync, [e.node for e in pools.placement(gpus_per_node)], dtype)


def check_transfer_plan(plan, spec) -> str:
    """``ok`` lines summarising ``plan`` (a ``TransferPlan``); raises :class:`CheckError` if it does not cover
    every engine tensor of ``spec`` exactly once at full size."""
    from megatron_maspo.rollout.transfer_plan import PlanCoverageError, check_coverage

    try:
        check_coverage(plan, spec)
    except PlanCoverageError as e:
        raise CheckError("transfer plan", str(e)) from None
    return "ok   " + plan.summary()
