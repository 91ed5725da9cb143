"""``maspo check`` steps about how the job's processes talk, from the layout alone (no model needed).

* :func:`check_process_groups`: every process group the job makes on GPUs with the backend it gets
  (``parallel/group_plan.py``); fails when a group that carries device tensors would be gloo.
* :func:`check_transfer_plan`: the disaggregated weight transfer's plan (``rollout/transfer_plan.py``): its
  senders, bytes per sender and largest link; fails when it leaves an engine tensor uncovered.
* :func:`check_weight_links`: the communicators each rank joins for the groups between the pools (by kind)
  and the NCCL buffers they need (``parallel/link_budget.py`` over ``PoolLayout.bridge_comms``, the list the
  bridges are built from); fails past ``rollout.weight_link_nccl_budget_mb``.
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
    shown = bridges if len(bridges) <= 8 else bridges[:4]
    rest = "" if shown is bridges else (f", ... and {len(bridges) - 4} more ("
                                        f"{sum(p.backend == 'nccl' for p in bridges[4:])} nccl, "
                                        f"{sum(p.backend != 'nccl' for p in bridges[4:])} gloo)")
    line += ("; bridges " + ", ".join(p.describe() for p in shown) + rest) if bridges else " (colocated: no bridges)"
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


def _who(pools, rank: int) -> str:
    if rank in pools.owner_ranks:
        return "an engine owner"
    return "a weight sender" if rank in pools.sender_ranks else "a trainer rank"


def check_weight_links(pools, rollout, gpus_per_node: int) -> str:
    """The ``weight links`` line: per rank, the most NCCL communicators and gloo groups it joins between
    the pools and the NCCL buffer bytes they need (model: ``parallel/link_budget.py``).

    Args:
        pools: the job's ``PoolLayout``.
        rollout: the config's ``rollout`` section (channels per link, budget).
        gpus_per_node: GPUs per node (which groups would share a GPU and stage on the host).

    Raises:
        CheckError: a rank's NCCL buffers exceed ``rollout.weight_link_nccl_budget_mb`` (one line).
    """
    from megatron_maspo.parallel.group_plan import PARENT, plan_groups
    from megatron_maspo.parallel.link_budget import MIB, nccl_channel_bytes, rank_costs

    plans = plan_groups(pools, gpus_per_node)
    ch = rollout.weight_link_channels
    costs = rank_costs(plans, ch).values()
    top = max(costs, key=lambda c: (c.nccl_bytes, c.nccl, -c.rank))
    gloo = max(costs, key=lambda c: (c.gloo, c.gloo_sockets, -c.rank))
    per = nccl_channel_bytes() / MIB
    budget = rollout.weight_link_nccl_budget_mb
    figure = (f"{top.nccl_bytes / MIB:,.0f} MiB of NCCL buffers ({top.links} payload communicator(s) x {ch} "
              f"channel(s) x {per:.1f} MiB)")
    if top.nccl_bytes > budget * MIB:
        raise CheckError("weight links", f"rank {top.rank} ({_who(pools, top.rank)}) would hold {figure} > "
                         f"rollout.weight_link_nccl_budget_mb={budget:g}: share fewer links "
                         f"(rollout.max_weight_links, now {rollout.max_weight_links}; broadcast only), use fewer "
                         "channels (rollout.weight_link_channels=1), send from fewer ranks "
                         "(rollout.sync_senders=rank0), or raise the budget where its GPU has the room")
    links = pools.weight_links
    parent = any(p.role == PARENT for p in plans)
    turns = max(link.senders for link in links)
    shared = f", up to {turns} senders taking turns on one" if turns > 1 else ""
    how = (f"{len(links)} link(s) for {len(pools.sender_ranks)} sender(s) ({rollout.sync_transport}, senders "
           f"{rollout.sync_senders}{shared})" + (", split from one parent" if parent else "") + ", made at start-up")
    return (f"ok   weight links: {how}; NCCL: at most {top.nccl} communicator(s) on a rank (rank {top.rank}, "
            f"{_who(pools, top.rank)}), {figure}, budget {budget:,.0f} MiB; gloo: at most {gloo.gloo} group(s) "
            f"(rank {gloo.rank}: {gloo.gloo_sockets} sockets, {gloo.gloo_threads} threads)")


def check_transfer_plan(plan, spec) -> str:
    """``ok`` lines summarising ``plan`` (a ``TransferPlan``); raises :class:`CheckError` if it does not cover
    every engine tensor of ``spec`` exactly once at full size."""
    from megatron_maspo.rollout.transfer_plan import PlanCoverageError, check_coverage

    try:
        check_coverage(plan, spec)
    except PlanCoverageError as e:
        raise CheckError("transfer plan", str(e)) from None
    return "ok   " + plan.summary()
