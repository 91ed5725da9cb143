"""Engines larger than a node: which process starts which part of one, and how they find each other.

An engine of ``rollout_tp > gpus_per_node`` GPUs takes ``k = rollout_tp / gpus_per_node`` whole nodes
(:func:`~.fleet.place_engine`). vLLM runs one TP group over them with its own multi-process launcher (no
Ray): the engine's owner starts ``vllm.LLM`` as node 0 of ``k`` (``nnodes=k, node_rank=0``), and on each
further node the first process of the job there (the node's *leader*, :attr:`~.fleet.EnginePlacement.leaders`)
starts that node's workers headless (``node_rank = 1 .. k-1``); all of them meet at the owner's address and
a port it picked (``master_addr`` / ``master_port``), where vLLM's workers build their torch.distributed
group (NCCL across the nodes on GPUs).

    every rank of the pool      rendezvous(): one all-gather of (rank, offer): the owner of each spanning
                                engine offers its host address and a free port, everyone else None
    owner (node 0)              VllmEngine(..., span=EngineSpan(node_rank=0, ...)): the LLM, the scheduler,
                                every RPC (sleep, wake, weight buckets) reaching all k nodes' workers
    leader of node j > 0        VllmNodeWorkers(span=EngineSpan(node_rank=j, ...)): the node's workers, no
                                scheduler; held until the job ends

Weights: a bucket handed over as a shared buffer (``ipc``) can be mapped only on the owner's node, so with
``k > 1`` the first worker maps it and broadcasts the bucket over the engine's own TP group to the others
(:func:`~.transport.relay_bucket`); ``bytes`` buckets travel in the RPC, which vLLM delivers to every node.

Pure except :func:`host_address` / :func:`rendezvous` (a socket name, one object all-gather).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_maspo.rollout.fleet import EnginePlacement


@dataclass(frozen=True)
class EngineSpan:
    """This process's part of an engine spanning nodes."""

    engine: int
    nnodes: int
    """Nodes the engine runs on (k)."""
    node_rank: int
    """0 on the owner (vLLM's head), 1 .. k-1 on the other nodes' leaders."""
    master_addr: str
    """The owner's host address, where vLLM's workers rendezvous."""
    master_port: int

    def __post_init__(self) -> None:
        if self.nnodes < 2 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"engine span: node_rank {self.node_rank} of {self.nnodes} nodes (an engine spans >= 2)")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"engine span: master_port {self.master_port} is not a port")

    @property
    def head(self) -> bool:
        """Whether this process runs the engine (its scheduler), not only a node's workers."""
        return self.node_rank == 0

    def vllm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` / ``EngineArgs`` arguments: vLLM's own multi-node launcher (``mp``, no Ray)."""
        return dict(distributed_executor_backend="mp", nnodes=self.nnodes, node_rank=self.node_rank,
                    master_addr=self.master_addr, master_port=self.master_port)


def role(placements: Sequence[EnginePlacement], rank: int) -> tuple[EnginePlacement, int] | None:
    """``(placement, node_rank)`` when global ``rank`` leads one of a spanning engine's nodes, else None
    (an engine inside one node, or a rank that is none of its nodes' leaders)."""
    for p in placements:
        if p.nodes > 1 and (j := p.node_rank_of(rank)) is not None:
            return p, j
    return None


def any_spans(placements: Sequence[EnginePlacement]) -> bool:
    """Whether some engine spans nodes (every rank knows it from the layout: the rendezvous is collective)."""
    return any(p.nodes > 1 for p in placements)


def host_address(environ: Any = None) -> str:
    """The address other nodes reach this host at: ``VLLM_HOST_IP`` (vLLM's own variable) or
    ``MASPO_ENGINE_HOST`` when set, loopback on one host split into emulated nodes
    (``comm.emulates_nodes``), else the host name's address."""
    from megatron_maspo.parallel import comm

    env = os.environ if environ is None else environ
    for key in ("VLLM_HOST_IP", "MASPO_ENGINE_HOST"):
        if env.get(key):
            return env[key]
    if comm.emulates_nodes(env):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def rendezvous(placements: Sequence[EnginePlacement], rank: int, *, all_gather: Callable[[Any], list],
               free_port: Callable[[], int]) -> EngineSpan | None:
    """This rank's :class:`EngineSpan` (None when it leads no node of a spanning engine).

    Collective over the group ``all_gather`` runs on (the pool's default group): every member calls it
    when :func:`any_spans`, each spanning engine's owner offering ``(host_address(), free_port())``.

    Raises:
        RuntimeError: the owner of this rank's engine made no offer (the ranks disagree on the layout).
    """
    mine = role(placements, rank)
    offer = (host_address(), free_port()) if mine is not None and mine[1] == 0 else None
    offers = dict(all_gather((rank, offer)))
    if mine is None:
        return None
    p, j = mine
    got = offers.get(p.owner)
    if got is None:
        raise RuntimeError(f"engine span: engine {p.engine}'s owner (rank {p.owner}) offered no address; "
                           "every rank must build the same layout")
    return EngineSpan(engine=p.engine, nnodes=p.nodes, node_rank=j, master_addr=got[0], master_port=int(got[1]))
