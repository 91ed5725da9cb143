"""What the groups between the pools cost each rank: communicators by kind, NCCL buffer bytes, gloo sockets.

Pure arithmetic over :func:`~megatron_maspo.parallel.group_plan.plan_groups`, which reads
``PoolLayout.bridge_comms``: the list ``train/rollouts/pool.py::bridges`` builds the bridges from, so the
counts here are those of the code that makes the groups, not a formula beside it. ``maspo check`` prints the
largest figures over the job's ranks and fails past ``rollout.weight_link_nccl_budget_mb``.

The model (NCCL and gloo facts read from their sources; docs/weight-transfer.md names them):

- **NCCL buffers.** A broadcast runs on rings, one per channel. On every channel a rank keeps two ring
  connections (from its predecessor, to its successor), and each connection has one buffer per protocol:
  Simple ``NCCL_BUFFSIZE`` (4 MiB by default), LL128 (120 x 640 x 8 x 8 B = 4.6875 MiB) and LL
  (8 x 512 x 8 x 16 B = 0.5 MiB). Across nodes the receive side keeps all three on the GPU and the send side
  its Simple and LL128 ones, so 2 x 9.19 MiB = 18.4 MiB per channel and rank is a bound a little above the
  real figure (17.9 MiB). A payload communicator has at most ``rollout.weight_link_channels`` channels
  (``ncclConfig_t.maxCTAs``). The split parent carries no collective: with NCCL's runtime connection (the
  default since 2.22) it never allocates ring buffers, and it is charged none. ``NCCL_BUFFSIZE``,
  ``NCCL_PROTO`` or ``NCCL_MAX_CTAS`` set on the cluster change these figures; the check assumes defaults.
- **gloo.** A host group has one TCP device that connects lazily (a socket per peer actually used, plus its
  listener) and one worker thread (``bridge.host_options``). Headers, stops and batches are broadcast from
  member 0 (on a link shared by several senders, from each of them in turn), which gloo runs as a binomial
  tree: a member exchanges with at most ``ceil(log2 n)`` peers per root.
- A host-staged payload group (two members on one GPU: the one-GPU smoke run) is gloo and costs no NCCL
  buffer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megatron_maspo.parallel.group_plan import NCCL, PARENT, PAYLOAD, GroupPlan

MIB = 1 << 20
NCCL_SIMPLE_BYTES = 4 * MIB
"""NCCL's default ``NCCL_BUFFSIZE``: the Simple protocol's buffer per connection."""
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
"""The LL128 protocol's default buffer per connection (elements per thread x threads x steps x 8 B)."""
NCCL_LL_BYTES = 8 * 512 * 8 * 16
"""The LL protocol's default buffer per connection (lines per thread x threads x steps x 16 B)."""
RING_CONNECTIONS = 2
"""Ring connections a rank keeps per channel: from its predecessor and to its successor."""


def nccl_channel_bytes() -> int:
    """GPU bytes of NCCL buffers one channel of a ring communicator costs a rank (about 18.4 MiB)."""
    return RING_CONNECTIONS * (NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES)


def broadcast_peer_set(index: int, size: int, root: int = 0) -> set[int]:
    """Members that member ``index`` of a ``size``-member gloo group exchanges with in a broadcast from
    ``root`` (gloo's binomial tree: round ``i`` pairs virtual ranks that differ in bit ``i``)."""
    v = (index - root) % size
    dim = max(0, (size - 1).bit_length())
    peers = set()
    mask = (1 << dim) - 1
    for i in range(dim):
        mask ^= 1 << i
        if v & mask == 0 and (v ^ (1 << i)) < size:
            peers.add(((v ^ (1 << i)) + root) % size)
    return peers


def broadcast_peers(index: int, size: int, root: int = 0) -> int:
    """How many peers :func:`broadcast_peer_set` has."""
    return len(broadcast_peer_set(index, size, root))


@dataclass
class RankCost:
    """The groups between the pools one rank joins, and what they take."""

    rank: int
    nccl: int = 0
    """NCCL communicators (the split parent included)."""
    links: int = 0
    """Payload communicators on NCCL (each charged its channels' buffers)."""
    gloo: int = 0
    """gloo groups (headers, batches, host-staged payloads)."""
    nccl_bytes: int = 0
    """GPU bytes of NCCL ring buffers (module docstring)."""
    gloo_sockets: int = 0
    """TCP sockets of the gloo groups: a listener each and one per peer their broadcasts from member 0 use."""
    gloo_threads: int = 0
    """Host threads of the gloo groups: the device's event loop and one worker each."""


def rank_costs(plans: Iterable[GroupPlan], channels: int) -> dict[int, RankCost]:
    """Every rank's :class:`RankCost` over the bridges in ``plans`` (the pools' own groups are left out:
    Megatron makes those and they are the same in every placement).

    Args:
        plans: ``plan_groups(layout, gpus_per_node)`` of a disaggregated layout.
        channels: ``rollout.weight_link_channels``, the channel cap of each payload communicator.
    """
    out: dict[int, RankCost] = {}
    for p in plans:
        if not p.role:
            continue
        for i, r in enumerate(p.ranks):
            c = out.setdefault(r, RankCost(r))
            if p.backend == NCCL:
                c.nccl += 1
                if p.role == PAYLOAD:
                    c.links += 1
                    c.nccl_bytes += channels * nccl_channel_bytes()
            else:
                c.gloo += 1
                peers = set().union(*(broadcast_peer_set(i, len(p.ranks), root) for root in range(p.roots)))
                c.gloo_sockets += 1 + len(peers)  # a pair's socket serves every root's tree
                c.gloo_threads += 2
            assert p.role in (PARENT, PAYLOAD) or p.backend != NCCL, p  # a host group is never NCCL
    return out
