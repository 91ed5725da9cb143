"""The process groups a job makes on GPUs, and the backend each one gets: the rule as data.

Pure arithmetic (no torch, no ``torch.distributed``): ``maspo check`` prints and checks it, and the runtime
imports :func:`gpu_backend` where it creates the groups, so both read one rule.

The rule (:func:`gpu_backend`)::

    carries device tensors, every member on its own GPU     nccl   (whatever the group's size or node count)
    host-only (pickled objects on CPU)                      gloo   (says so: no device tensor goes through it)
    carries device tensors, two members on one GPU          gloo   NCCL refuses two ranks on one GPU

A device group's backend never depends on how many ranks it has: a pool larger than one node's GPUs is
still NCCL (its TP / DP / PP / EP groups inherit the default group's backend, so a gloo default would
run every model-parallel collective on CUDA tensors through TCP). The last row is only legal where the
group stages its payload on the host instead; :func:`validate` refuses a device group that would be gloo.

The groups (:func:`plan_groups`), ranks global, laid out node-major (rank r on node ``r // ranks_per_node``,
GPU ``(r % ranks_per_node) % gpus_per_node``: one GPU per rank unless a node runs more ranks than it has):

    colocated       ``world``    every rank; Megatron's groups are carved from it              device
    disaggregated   ``train``    training pool 0..T-1 (``rollout/pools.py::PoolLayout``)         device
                    ``rollout``  rollout pool T..W-1 (engines' object collectives stage on GPU)  device
                    ``weights``  trainer rank 0 + every engine owner: weight buckets GPU to GPU  device, or
                                 host-staged (gloo) when two of its members share a GPU
                    ``weights_parent``  every sender + every owner, when there are several broadcast
                                 links: the NCCL communicator each link's is split from (no traffic)
                    ``batches``  lead engine + every trainer rank: pickled batches on the host   host-only

An engine larger than a node (``rollout/engine_span.py``) adds no group of the job: its TP group is vLLM's
own, built by its workers across the nodes (NCCL on GPUs), and the rendezvous that tells its node leaders
the owner's address is one object all-gather on the pool's default group.

The groups between the pools come from ``PoolLayout.bridge_comms`` (:class:`CommSpec`, in build order), the
same list ``train/rollouts/pool.py::bridges`` builds them from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

NCCL, GLOO = "nccl", "gloo"


class PoolLayoutLike(Protocol):
    """What :func:`plan_groups` reads of a disaggregated job's ``rollout.pools.PoolLayout`` (a structural
    type: ``parallel/`` sits below ``rollout/`` and does not import it)."""

    @property
    def trainer_world(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def batches_ranks(self) -> Sequence[int]: ...

    @property
    def bridge_comms(self) -> Sequence[CommSpec]: ...


PARENT, PAYLOAD, HOST = "parent", "payload", "host"
"""Roles of a group between the pools (:attr:`CommSpec.role`)."""


@dataclass(frozen=True)
class CommSpec:
    """One group between the pools, in the order every rank builds them (``PoolLayout.bridge_comms``)."""

    name: str
    """The bridge's store prefix (``weights``, ``weights_s8_ctl``, ``batches``, ...)."""
    ranks: tuple[int, ...]
    """Global ranks, member 0 first (the sender, or the lead engine for ``batches``)."""
    role: str
    """``parent``: the NCCL communicator the payload groups are split from (it carries nothing);
    ``payload``: device bucket bytes; ``host``: headers, stop, pickled batches (gloo)."""
    parent: str | None = None
    """A payload group's parent (its NCCL communicator is a split of that one), None: made on its own."""
    color: int = 0
    """A split payload group's colour in ``ncclCommSplit`` (its link's index)."""
    roots: int = 1
    """Members that broadcast on it: a weight link's senders, members ``0 .. roots - 1``, taking turns."""


@dataclass(frozen=True)
class GroupPlan:
    """One process group of the job as it will be on GPUs."""

    name: str
    """``world`` (colocated), ``train`` / ``rollout`` (the pools' default groups), ``weights`` / ``batches``
    (the bridges between the pools)."""
    ranks: tuple[int, ...]
    """Global ranks, group rank order."""
    carries_device: bool
    """Device (CUDA) tensors go through it; False for a host-only group (pickled objects, host buffers)."""
    backend: str
    """``nccl`` or ``gloo``: what it gets on GPUs (:func:`gpu_backend`)."""
    shares_gpu: bool = False
    """Two of its members sit on one GPU."""
    why: str = ""
    """What it carries, in a few words (printed by ``maspo check``)."""
    role: str = ""
    """For a group between the pools, its :attr:`CommSpec.role`; ``""`` for a pool's own group."""
    roots: int = 1
    """:attr:`CommSpec.roots`: members ``0 .. roots - 1`` broadcast on it."""

    def describe(self) -> str:
        """``name (ranks 0-15) nccl [why]`` on one line."""
        return f"{self.name} ({format_ranks(self.ranks)}) {self.backend}" + (f" [{self.why}]" if self.why else "")


class GroupPlanError(ValueError):
    """A device-carrying group would be gloo on GPUs; ``str`` is one line naming the group and its ranks."""


def gpu_backend(carries_device: bool, members_share_a_gpu: bool) -> str:
    """The backend a group gets on GPUs (module docstring); never a function of the group's size.

    Args:
        carries_device: CUDA tensors go through the group (False: host-only, e.g. pickled objects).
        members_share_a_gpu: two of its members are processes on the same GPU.

    Returns:
        ``"nccl"`` for a device group whose members each have their own GPU, else ``"gloo"``.
    """
    return NCCL if carries_device and not members_share_a_gpu else GLOO


def gpu_of(rank: int, gpus_per_node: int, ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(node, gpu)`` of global ``rank``: node-major, local rank ``l`` on GPU ``l % gpus_per_node`` (only a
    node running more ranks than it has GPUs puts two on one)."""
    if gpus_per_node < 1:
        raise ValueError(f"group plan: gpus_per_node must be >= 1, got {gpus_per_node}")
    per_node = ranks_per_node or gpus_per_node
    return rank // per_node, (rank % per_node) % gpus_per_node


def members_share_a_gpu(ranks: tuple[int, ...], gpus_per_node: int, ranks_per_node: int | None = None) -> bool:
    """Whether two of ``ranks`` sit on one GPU (:func:`gpu_of`): the second argument of :func:`gpu_backend`."""
    gpus = [gpu_of(r, gpus_per_node, ranks_per_node) for r in ranks]
    return len(set(gpus)) < len(gpus)


def _device_group(name: str, ranks: tuple[int, ...], why: str, gpus_per_node: int,
                  ranks_per_node: int | None) -> GroupPlan:
    shares = members_share_a_gpu(ranks, gpus_per_node, ranks_per_node)
    return GroupPlan(name, ranks, True, gpu_backend(True, shares), shares,
                     why + ("; two ranks on one GPU" if shares else ""))


def plan_groups(layout: PoolLayoutLike | int, gpus_per_node: int, *,
                ranks_per_node: int | None = None) -> tuple[GroupPlan, ...]:
    """Every process group the job makes on GPUs, with its ranks and backend (module docstring).

    Args:
        layout: the job's :class:`~megatron_maspo.rollout.pools.PoolLayout` (disaggregated), or its world
            size (colocated: one pool).
        gpus_per_node: GPUs each node has.
        ranks_per_node: processes each node runs (default ``gpus_per_node``: one per GPU).

    Returns:
        Colocated: ``(world,)``; disaggregated: ``(train, rollout, weights, weights_ctl, batches)``, with one
        more ``weights_s<rank>`` / ``_ctl`` pair per further sender and then a ``weights_parent`` first
        (``PoolLayout.bridge_comms``).
    """
    if isinstance(layout, int):
        return (_device_group("world", tuple(range(layout)), "the one pool; Megatron's groups inherit it",
                              gpus_per_node, ranks_per_node),)
    t = layout.trainer_world
    train = _device_group("train", tuple(range(t)), "training pool; Megatron's TP/DP/PP/EP groups inherit it",
                          gpus_per_node, ranks_per_node)
    rollout = _device_group("rollout", tuple(range(t, layout.world)),
                            "rollout pool; object collectives stage on the GPU", gpus_per_node, ranks_per_node)
    bridges: list[GroupPlan] = []
    parent_shares: dict[str, bool] = {}
    for c in layout.bridge_comms:  # the list the bridges are built from, in their order
        shares = members_share_a_gpu(tuple(c.ranks), gpus_per_node, ranks_per_node)
        if c.role == PARENT:
            parent_shares[c.name] = shares
            if not shares:  # two members on one GPU: no parent; the links are made on their own
                bridges.append(GroupPlan(c.name, tuple(c.ranks), False, NCCL, False,
                                         "the links' NCCL communicators are split from it; carries nothing",
                                         role=PARENT))
        elif c.role == PAYLOAD and shares:  # NCCL refuses: buckets via the host
            bridges.append(GroupPlan(c.name, tuple(c.ranks), False, gpu_backend(False, True), True,
                                     "two members share a GPU: buckets staged on the host", role=PAYLOAD,
                                     roots=c.roots))
        elif c.role == PAYLOAD:
            split = c.parent is not None and not parent_shares.get(c.parent, True)
            bridges.append(GroupPlan(c.name, tuple(c.ranks), True, gpu_backend(True, False), False,
                                     "weight buckets GPU to GPU" + (f", split from {c.parent}" if split else "")
                                     + (f", {c.roots} senders in turns" if c.roots > 1 else ""),
                                     role=PAYLOAD, roots=c.roots))
        else:
            why = ("pickled batches on the CPU (host-only)" if c.name == "batches" else
                   "bucket headers, end, stop (host-only: no NCCL work pending between syncs)")
            bridges.append(GroupPlan(c.name, tuple(c.ranks), False, gpu_backend(False, False), False, why,
                                     role=HOST, roots=c.roots))
    return train, rollout, *bridges


def validate(plans: tuple[GroupPlan, ...] | list[GroupPlan]) -> None:
    """Raise :class:`GroupPlanError` at the first group that carries device tensors but would be gloo."""
    for p in plans:
        if p.carries_device and p.backend != NCCL:
            reason = "two of its ranks share a GPU and NCCL refuses that" if p.shares_gpu else "gloo on CUDA tensors"
            raise GroupPlanError(f"process group {p.name!r} ({format_ranks(p.ranks)}) carries device tensors but "
                                 f"would be {p.backend} on GPUs ({reason}): give each rank its own GPU")


def format_ranks(ranks: tuple[int, ...]) -> str:
    """Runs of consecutive ranks in group order: ``ranks 0-15``, ``ranks 0, 16-31``, ``rank 3``."""
    if not ranks:
        return "no ranks"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    shown = ", ".join(text[:4]) + (f", ... ({len(ranks)} ranks)" if len(text) > 4 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown
