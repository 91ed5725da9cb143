"""The weight-transfer plan: which trainer rank sends which engine tensor, at which bytes, to which engines.

Computed once from the family registry's conversion table (``conversion/plan.py::global_items``, the same
table the export and the offline converter read) and the two layouts, and plain data from then on: the
sharded sync sends by it, ``maspo check`` prints and checks it, ``maspo plan`` models its links.

Trainer layout (Megatron's rank order tp-cp-ep-dp-pp, tensor fastest; one pipeline stage is the
``tp·cp·dp`` consecutive ranks from ``s·tp·cp·dp``)::

    dense tensor of stage s        sent by rank  s·tp·cp·dp           (tp 0, cp 0, dp 0 of stage s)
    expert e (EP rank j = e // (E/ep)) of stage s
                                   sent by rank  s·tp·cp·dp + k·ep + j   (expert-DP rank k, below)
    stage of a layer               layer l on chunk c = l // (L / (pp·vpp)), stage c mod pp (interleaved)
    embedding / final norm, head   first / last stage (a tied head is the embedding: sent once)

Experts are never split over TP (``parallel/groups.py`` builds Megatron with expert TP 1), so Megatron's
expert grid is its ``RankGenerator(tp=1, ep, dp=tp·cp·dp/ep, pp)``: inside a stage, EP rank j of expert-DP
replica k is stage rank ``k·ep + j`` (:meth:`TrainerLayout.expert_rank`), and every such rank holds the
experts of EP rank j whole. Which replica sends them: the first k with ``k·ep + j >= tp``, i.e. a rank
outside the dense sender's TP group, and k = 0 when the stage has no replica there (``tp·cp·dp/ep`` = 1, or
every replica of j inside that group). The dense sender's export all-gathers the TP shards of every layer
from its TP group; an expert sender outside that group has no collective in its export at all, so no
sender's export waits for another sender's link to be drained (the owners read all links at once anyway,
``pool_sync.WeightReceiver``, which is what keeps a TP 2 x EP 2 stage without replicas, where EP rank 1 is
the dense sender's TP peer, from deadlocking). It also takes the expert bytes off the dense sender.

``senders="rank0"`` is the funnel (every tensor from trainer rank 0, today's path, kept for comparison).

TP shards are gathered inside the TP group and sent whole (not sent as shards and joined by the engine).
Both move the same inter-node bytes: every engine needs one full copy of every tensor either way. Gathering
first costs (tp-1)/tp of the stage's bytes on the TP group's links, which are the intra-node ones
(NVLink, ~10x the bandwidth of a node's network link), and it keeps the engine side untouched: vLLM's
``load_weights`` and the built-in engine take full HF tensors and re-shard for their own TP, and joining
Megatron's QKV-grouped and gate/up-interleaved shards needs the family's merge rules, which live on the
trainer. Sending shards would cut ``sender_bytes_max`` by another factor tp, at the price of putting
the merge (and its per-family bugs) in every engine; the per-stage split already meets the done-when.

Byte ranges: each :class:`TensorSend` carries ``[start, start + nbytes)`` in its sender's stream (the
concatenation of the tensors that rank sends, in the export's global order; bucket padding excluded), so a
receiver or a transport can place a tensor without any header. Colocated sync is the same plan with
every engine being the local one (``engines=(0,)``, one destination).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_maspo.rollout.config import SYNC_SENDERS

if TYPE_CHECKING:
    from megatron_maspo.model.spec import ArchSpec

SENDERS = SYNC_SENDERS
"""``rollout.sync_senders``: every stage (and EP rank) sends its own tensors, or trainer rank 0 sends all."""

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class PlanCoverageError(ValueError):
    """A plan leaves an engine tensor uncovered, covers one twice, or at the wrong size."""


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """The training pool's Megatron layout (ranks ``first_rank .. first_rank + world - 1``)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    vpp: int | None = None
    first_rank: int = 0
    pp_first: int | None = None
    """Layers of the first / last stage of an uneven split (``parallel/pipeline_split.py``); None = even."""
    pp_last: int | None = None

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: ``tp·cp·dp``."""
        return self.tp * self.cp * self.dp

    @property
    def world(self) -> int:
        return self.stage_size * self.pp

    def dense_sender(self, stage: int) -> int:
        """Global rank that sends stage ``stage``'s non-expert tensors (tp 0, cp 0, dp 0)."""
        return self.first_rank + stage * self.stage_size

    @property
    def expert_replicas(self) -> int:
        """Expert-DP replicas of one stage: ``tp·cp·dp / ep`` (Megatron's expert-DP size, expert TP 1)."""
        if self.stage_size % self.ep:
            raise ValueError(f"transfer plan: ep={self.ep} does not divide a stage's tp*cp*dp={self.stage_size} "
                             "ranks")
        return self.stage_size // self.ep

    def expert_rank(self, stage: int, ep_rank: int, replica: int = 0) -> int:
        """Global rank of EP rank ``ep_rank`` of expert-DP replica ``replica`` on stage ``stage``
        (Megatron's expert grid with expert TP 1: ``s·tp·cp·dp + replica·ep + ep_rank``)."""
        if not (0 <= ep_rank < self.ep and 0 <= replica < self.expert_replicas):
            raise ValueError(f"transfer plan: EP rank {ep_rank} / expert-DP replica {replica} outside ep={self.ep}"
                             f" x {self.expert_replicas}")
        return self.dense_sender(stage) + replica * self.ep + ep_rank

    def expert_sender(self, stage: int, ep_rank: int) -> int:
        """Global rank that sends EP rank ``ep_rank``'s experts on stage ``stage``: its first expert-DP
        replica outside the dense sender's TP group, else replica 0 (module docstring)."""
        outside = [k for k in range(self.expert_replicas) if k * self.ep + ep_rank >= self.tp]
        return self.expert_rank(stage, ep_rank, outside[0] if outside else 0)

    def senders(self, *, moe: bool) -> tuple[int, ...]:
        """Every rank that sends in a ``"stages"`` sync, ascending: each stage's dense sender, plus its EP
        ranks' expert senders for a MoE model."""
        out = {self.dense_sender(s) for s in range(self.pp)}
        if moe:
            out |= {self.expert_sender(s, j) for s in range(self.pp) for j in range(self.ep)}
        return tuple(sorted(out))

    def layer_stage(self, layer: int, num_layers: int) -> int:
        """Pipeline stage holding global layer ``layer`` (Megatron's split, even or uneven, interleaved
        over virtual chunks: :class:`~megatron_maspo.parallel.pipeline_split.PipelineSplit`)."""
        from megatron_maspo.parallel.pipeline_split import PipelineSplit

        try:
            split = PipelineSplit(num_layers, self.pp, self.vpp, self.pp_first, self.pp_last)
        except ValueError as e:
            raise ValueError(f"transfer plan: {e}") from None
        return split.stage_of(layer)


@dataclass(frozen=True)
class TensorSend:
    """One engine tensor: who sends it, where it sits in that sender's stream, who receives it."""

    name: str
    """HF checkpoint name (what the engine loads)."""
    shape: tuple[int, ...]
    nbytes: int
    """Full tensor bytes in the engine dtype."""
    sender: int
    """Global trainer rank that puts it on the wire."""
    start: int
    """Byte offset of its first byte in the sender's stream (``[start, start + nbytes)``)."""
    stage: int
    """Pipeline stage owning it."""
    engines: tuple[int, ...]
    """Global ranks of the engine owners receiving it."""


@dataclass(frozen=True)
class TransferPlan:
    """Every engine tensor once, in the export's global order; plain data."""

    sends: tuple[TensorSend, ...]
    engines: tuple[int, ...]
    senders_mode: str
    dtype: str

    @property
    def senders(self) -> tuple[int, ...]:
        """Ranks that send anything, ascending (the first is always the stage-0 dense sender)."""
        return tuple(sorted({s.sender for s in self.sends}))

    def for_rank(self, rank: int) -> list[TensorSend]:
        """What ``rank`` sends, in stream order."""
        return [s for s in self.sends if s.sender == rank]

    def bytes_by_sender(self) -> dict[int, int]:
        """Distinct payload bytes each sender puts on the wire (a tensor sent to several engines counts once)."""
        out: dict[int, int] = defaultdict(int)
        for s in self.sends:
            out[s.sender] += s.nbytes
        return dict(sorted(out.items()))

    @property
    def bytes_total(self) -> int:
        """One copy of the exported model in the engine dtype."""
        return sum(s.nbytes for s in self.sends)

    @property
    def sender_bytes_max(self) -> int:
        return max(self.bytes_by_sender().values(), default=0)

    def links(self) -> dict[tuple[int, int], int]:
        """Bytes per (sender, engine owner) link."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for s in self.sends:
            for e in s.engines:
                out[(s.sender, e)] += s.nbytes
        return dict(out)

    def largest_link(self) -> tuple[tuple[int, int], int]:
        """The (sender, engine) link carrying most bytes, and its bytes."""
        links = self.links()
        key = max(links, key=lambda k: (links[k], -k[0], -k[1]))
        return key, links[key]

    def summary(self) -> str:
        """Three lines for ``maspo check``: senders, bytes per sender, the largest link."""
        per = self.bytes_by_sender()
        (src, dst), big = self.largest_link()
        share = self.sender_bytes_max / max(self.bytes_total, 1)
        shown = list(per.items())
        listed = ", ".join(f"rank {r}: {_size(b)}" for r, b in shown[:8]) + (", ..." if len(shown) > 8 else "")
        return "\n".join([
            f"transfer plan ({self.senders_mode}, {self.dtype}): {len(per)} sender(s) -> {len(self.engines)} "
            f"engine(s), {len(self.sends)} tensors, {_size(self.bytes_total)} per sync",
            f"     bytes per sender: {listed} (max/total {share:.2f})",
            f"     largest link: rank {src} -> engine owner {dst}, {_size(big)}"])


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def build_plan(spec: ArchSpec, layout: TrainerLayout, engines: Sequence[int], *, dtype: str = "bfloat16",
               senders: str = "stages") -> TransferPlan:
    """The transfer plan of ``spec`` from a trainer ``layout`` to the engine owners ``engines``.

    Args:
        spec: the architecture (its family's conversion table names the engine tensors).
        layout: the trainer's layout.
        engines: global ranks of the engine owners (colocated: the local engine alone).
        dtype: the engine dtype (``"bfloat16"``, ``"float32"``, ...).
        senders: ``"stages"`` (each stage / EP rank sends its own) or ``"rank0"`` (the funnel).

    Raises:
        ValueError: unknown ``senders`` or dtype, no engine, or a layout the model does not split over.
    """
    from megatron_maspo.conversion.mapping import is_expert
    from megatron_maspo.conversion.plan import (  # torch: only when a plan is built
        global_items,
        hf_shape,
    )

    if senders not in SENDERS:
        raise ValueError(f"rollout.sync_senders={senders!r}; accepted: {', '.join(SENDERS)}")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"transfer plan: engine dtype {dtype!r}; accepted: {sorted(_DTYPE_BYTES)}")
    if not engines:
        raise ValueError("transfer plan: no engine to send to")
    experts_per_rank = (spec.num_moe_experts or 0) // layout.ep if spec.is_moe else 0
    dests = tuple(engines)
    offsets: dict[int, int] = defaultdict(int)
    sends = []
    for item in global_items(spec):
        if item.layer is not None:
            stage = layout.layer_stage(item.layer, spec.num_layers)
        else:
            stage = 0 if item.section == "pre" else layout.pp - 1
        expert = is_expert(item.entry)
        per_expert = len(item.entry.hf_names)
        for i, name in enumerate(item.hf_names(spec)):
            if senders == "rank0":
                src = layout.first_rank
            elif expert:
                src = layout.expert_sender(stage, (i // per_expert) // experts_per_rank)
            else:
                src = layout.dense_sender(stage)
            shape = hf_shape(name, spec)
            nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
            sends.append(TensorSend(name, shape, nbytes, src, offsets[src], stage, dests))
            offsets[src] += nbytes
    return TransferPlan(tuple(sends), dests, senders, dtype)


def check_coverage(plan: TransferPlan, spec: ArchSpec) -> None:
    """Every engine tensor of ``spec`` covered exactly once, at full size, by contiguous byte ranges.

    Raises:
        PlanCoverageError: naming the first few uncovered, doubly covered, unknown or wrong-size tensors,
            or a sender whose byte ranges overlap or leave a gap.
    """
    from megatron_maspo.conversion.plan import hf_shape, hf_state_dict_keys

    want = {n: math.prod(hf_shape(n, spec)) * _DTYPE_BYTES[plan.dtype] for n in hf_state_dict_keys(spec)}
    counts = Counter(s.name for s in plan.sends)
    problems = []
    missing = [n for n in want if n not in counts]
    if missing:
        problems.append(f"{len(missing)} engine tensor(s) uncovered, e.g. {missing[:3]}")
    twice = [n for n, c in counts.items() if c > 1]
    if twice:
        problems.append(f"{len(twice)} covered more than once, e.g. {twice[:3]}")
    unknown = [n for n in counts if n not in want]
    if unknown:
        problems.append(f"{len(unknown)} not engine tensors, e.g. {unknown[:3]}")
    wrong = [f"{s.name} ({s.nbytes} of {want[s.name]} bytes)" for s in plan.sends
             if s.name in want and s.nbytes != want[s.name]]
    if wrong:
        problems.append(f"{len(wrong)} at the wrong size, e.g. {wrong[:3]}")
    undelivered = [s.name for s in plan.sends if not s.engines]
    if undelivered:
        problems.append(f"{len(undelivered)} sent to no engine, e.g. {undelivered[:3]}")
    for rank in plan.senders:
        pos = 0
        for s in plan.for_rank(rank):
            if s.start != pos:
                problems.append(f"rank {rank}'s stream has {s.name} at byte {s.start}, expected {pos}")
                break
            pos += s.nbytes
    if problems:
        raise PlanCoverageError("transfer plan does not cover the engine's tensors: " + "; ".join(problems))


def plan_pool_transfer(spec: ArchSpec, pools: Any, dtype: str) -> TransferPlan:
    """The checked ``"stages"`` plan of a disaggregated job (``pools``: its ``rollout.pools.PoolLayout``).

    Raises:
        PlanCoverageError: the plan leaves an engine tensor uncovered (or covers one twice).
        ValueError: the plan names a sender outside the training pool or without a weight link, or a link
            names a rank twice (``bridge.Bridge`` would refuse it at start-up).
    """
    plan = build_plan(spec, pools.trainer_layout, pools.owner_ranks, dtype=dtype, senders="stages")
    check_coverage(plan, spec)
    trainers = pools.trainer_world
    outside = sorted(r for r in plan.senders if not 0 <= r < trainers)
    if outside:
        raise ValueError(f"transfer plan: senders {outside[:4]} lie outside the training pool (ranks 0-{trainers - 1})"
                         " (an expert rank formula that disagrees with Megatron's expert grid)")
    for link in pools.weight_links:
        if len(set(link.ranks)) != len(link.ranks):
            raise ValueError(f"transfer plan: weight link {link.name!r} names a rank twice: {link.ranks}")
    linked = set(pools.sender_ranks)
    if not set(plan.senders) <= linked:
        raise ValueError(f"transfer plan: ranks {sorted(set(plan.senders) - linked)} send weights but have no "
                         f"link to the rollout pool (linked senders {sorted(linked)})")
    return plan
