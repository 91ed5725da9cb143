"""The shape-only steps of ``maspo check``: each takes what was built and raises :class:`CheckError` naming
the first mismatch (the step, the rank coordinate, the tensor or GPU, and why).

Per built rank (meta-device ``GPTModel`` chunks):

* :func:`check_names`: the conversion tables against the chunk's real parameter names, both ways: every
  table entry resolves to a parameter (``conversion/plan.resolve``) with the shape the HF tensor implies
  at this TP, and every parameter is claimed by an entry (an unclaimed one would be neither loaded nor
  synced). With ``te=True`` the names are first renamed to the TE spec's (``model/te_names.py``).
* :func:`sharded_shards`: the checkpoint's sharded-state-dict entries; :func:`check_checkpoint_cover`
  then checks, over all ranks, that each key has one global shape and that its main-replica shards tile it
  exactly (a gap is a tensor no rank saves, an overlap two ranks writing one slice).

Once per layout: :func:`check_stage_manifest` (one owning stage per layer, embedding and head),
:func:`check_bucket_plan` (the sync's export manifest, i.e. every HF tensor in export order
with its shape and the rollout dtype, laid into buckets of ``rollout.bucket_mb``), :func:`check_placement`
(each engine's GPUs on each node; :func:`check_pool_placement` for a disaggregated job's rollout pool),
:func:`check_memory` (the planner's per-GPU parameter counts and offload
bytes against the built chunks').
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


class CheckError(Exception):
    """A mismatch; ``str`` is the one line ``maspo check`` prints."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"[{step}] {message}")
        self.step, self.message = step, message

    def __reduce__(self):  # raised in a worker process of check/ranks.py: rebuilt from both fields
        return (CheckError, (self.step, self.message))


@dataclass
class RankCounts:
    """Parameters one built rank holds (``numel``), split as the planner splits them."""

    dense: int
    expert: int
    bytes_per_param: int


def _params(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    from megatron_maspo.model.checkpoint import unwrap

    return dict(unwrap(chunk).named_parameters())


def renamed_to_te(params: dict[str, torch.Tensor], *, moe: bool | Callable[[str], bool],
                  grouped: bool) -> dict[str, torch.Tensor]:
    """``params`` under the TE spec's names (the recorded list: TE itself cannot be built here); ``moe``:
    every layer has experts, or a function of the local name saying whether its layer does."""
    from megatron_maspo.model.te_names import te_name

    is_moe = moe if callable(moe) else (lambda _n: moe)
    return {te_name(n, moe_layer=is_moe(n), grouped_gemm=grouped): t for n, t in params.items()}


def _moe_layer_of(chunk: torch.nn.Module, spec) -> Callable[[str], bool]:
    """Local parameter name -> whether its decoder layer has routed experts (dense first layers)."""
    from megatron_maspo.conversion.plan import chunk_layers

    layers = chunk_layers(chunk)

    def moe(name: str) -> bool:
        m = re.match(r"(?:.*\.)?decoder\.layers\.(\d+)\.", name)
        return spec.is_moe_layer(layers[int(m[1])]) if m else spec.is_moe
    return moe


def _expected_local_shape(entry, hf_shapes: list[tuple[int, ...]], tp: int, vocab_rows: int) -> tuple[int, ...]:
    """Shape of the Megatron tensor ``entry`` maps to on one TP rank, from the HF shapes it covers."""
    from megatron_maspo.conversion.hybrid_shard import HYBRID_ENTRIES
    from megatron_maspo.conversion.mapping import QKV, Direct, GatedMLP

    if isinstance(entry, (QKV, GatedMLP, *HYBRID_ENTRIES)):  # fused along dim 0, then split over TP
        first = hf_shapes[0]
        return (sum(s[0] for s in hf_shapes) // tp, *first[1:])
    assert isinstance(entry, Direct)
    shape = list(hf_shapes[0])
    if entry.vocab:
        shape[0] = vocab_rows
    if entry.split is not None:
        shape[entry.split] //= tp
    return tuple(shape)


def check_names(chunks: list[torch.nn.Module], spec, *, tp: int, ep: int, ep_rank: int, vocab_rows: int,
                where: str, te: bool = False, grouped: bool = False) -> int:
    """Conversion tables vs the chunks' parameter names and shapes, both directions; returns names checked."""
    from megatron_maspo.conversion.plan import (
        chunk_tensors,
        hf_shape,
        local_items,
        mcore_names,
        resolve,
    )
    from megatron_maspo.model.checkpoint import unwrap

    checked = 0
    for chunk in chunks:
        params = chunk_tensors(chunk)  # parameters and the routers' correction-bias buffers
        if te:
            params = renamed_to_te(params, moe=_moe_layer_of(chunk, spec), grouped=grouped)
        claimed: set[str] = set()
        for item, local_layer in local_items(chunk, spec):
            names = mcore_names(item, local_layer, spec, ep, ep_rank)
            hf = [hf_shape(n, spec) for n in item.hf_names(spec)]
            per = len(item.entry.hf_names)
            for mname, expert in names:
                try:
                    key = resolve(params, mname)
                except ValueError as e:
                    raise CheckError("tables", f"{where}: {e}") from None
                g = expert or 0  # HF names of an expert entry run expert by expert
                want = _expected_local_shape(item.entry, hf[g * per:(g + 1) * per],
                                             1 if expert is not None else tp, vocab_rows)
                got = tuple(params[key].shape)
                if got != want:
                    raise CheckError("tables", f"{where}: {key} has shape {got}, the table's HF tensors "
                                               f"{item.hf_names(spec)[:per]} imply {want}")
                claimed.add(key)
                checked += 1
        model = unwrap(chunk)
        tied_copy = {"output_layer.weight"} if spec.tie_word_embeddings and not model.pre_process else set()
        left = sorted(set(params) - claimed - tied_copy)
        if left:
            raise CheckError("tables", f"{where}: parameter {left[0]} is in no conversion-table entry (it would be "
                                       f"neither loaded from HF nor synced); {len(left)} such")
    return checked


def rank_counts(chunks: list[torch.nn.Module]) -> RankCounts:
    """Dense / expert parameter counts of one rank (the tied head copy on a last stage included, as the
    planner counts it)."""
    dense = expert = 0
    size = 0
    for chunk in chunks:
        for name, p in _params(chunk).items():
            size = max(size, p.element_size())
            if ".experts." in name:
                expert += p.numel()
            else:
                dense += p.numel()
    return RankCounts(dense, expert, size)


def sharded_shards(chunks: list[torch.nn.Module]) -> Iterable[tuple[str, tuple, tuple, tuple]]:
    """``(key, global_shape, global_offset, local_shape)`` of every main-replica ShardedTensor this rank saves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_maspo.model.checkpoint import model_sharded_state_dict

    for v in nested_values(model_sharded_state_dict(chunks)):
        items = v.build() if isinstance(v, ShardedTensorFactory) else [v]
        for sh in nested_values(items) if isinstance(items, (dict, list)) else [items]:
            if not isinstance(sh, ShardedTensor):
                continue
            rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
            if any(rid):
                continue  # another rank saves this slice
            yield sh.key, tuple(sh.global_shape), tuple(sh.global_offset), tuple(sh.local_shape)


def check_checkpoint_cover(shards: Iterable[tuple[str, tuple, tuple, tuple]]) -> int:
    """Every key's main-replica shards (from all ranks) tile its global shape once; returns the key count."""
    by_key: dict[str, tuple[tuple, dict[tuple, int]]] = {}
    for key, gshape, offset, lshape in shards:
        shape0, seen = by_key.setdefault(key, (gshape, {}))
        if shape0 != gshape:
            raise CheckError("checkpoint", f"key {key!r} has global shape {gshape} on one rank and {shape0} on another")
        if offset in seen:
            raise CheckError("checkpoint", f"key {key!r}: two ranks save the slice at offset {offset}")
        seen[offset] = math.prod(lshape)
    for key, (gshape, seen) in by_key.items():
        if sum(seen.values()) != math.prod(gshape):
            raise CheckError("checkpoint", f"key {key!r}: the ranks' shards cover {sum(seen.values())} of "
                                           f"{math.prod(gshape)} elements of {gshape}")
    return len(by_key)


def stage_manifest(chunks: list[torch.nn.Module]) -> dict:
    """This rank's entry of the export's per-stage manifest (``megatron_to_hf._manifest``): embedding?,
    head?, its global layers."""
    from megatron_maspo.conversion.plan import chunk_layers
    from megatron_maspo.model.checkpoint import unwrap

    models = [unwrap(c) for c in chunks]
    return {"pre": any(m.pre_process for m in models), "post": any(m.post_process for m in models),
            "layers": [i for m in models for i in chunk_layers(m)]}


def check_stage_manifest(stages: dict[int, dict], num_layers: int) -> None:
    """The export finds one owner for the embedding, the head and every layer (else it raises mid-sync)."""
    owners: dict[int, int] = {}
    for pp, m in sorted(stages.items()):
        for layer in m["layers"]:
            if owners.setdefault(layer, pp) != pp:
                raise CheckError("weight sync", f"layer {layer} is held by pipeline stages {owners[layer]} and {pp}")
    if sorted(owners) != list(range(num_layers)):
        raise CheckError("weight sync", f"the stages hold layers {sorted(owners)[:4]}..., the model has {num_layers}")
    for key in ("pre", "post"):
        if sum(m[key] for m in stages.values()) != 1:
            raise CheckError("weight sync", f"{sum(m[key] for m in stages.values())} pipeline stages hold the "
                                            f"{'embedding' if key == 'pre' else 'output head'}, the export needs one")


def export_manifest(spec, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """What one weight sync streams: every HF tensor in the export's global order, in the rollout dtype."""
    from megatron_maspo.conversion.plan import hf_shape, hf_state_dict_keys

    return [(n, dtype, hf_shape(n, spec)) for n in hf_state_dict_keys(spec)]


def check_bucket_plan(manifest: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> tuple[int, int]:
    """Lay the manifest into buckets exactly as the sync packs it; returns (buckets, largest tensor bytes)."""
    from megatron_maspo.rollout import buckets as B

    try:
        plan = list(B.plan_buckets(manifest, bucket_bytes))
    except ValueError as e:
        raise CheckError("weight sync", str(e)) from None
    got: dict[str, int] = {}
    for i, metas in enumerate(plan):
        used = max((m.offset + m.span for m in metas), default=0)
        if used > bucket_bytes:
            raise CheckError("weight sync", f"bucket {i} needs {used} bytes > rollout.bucket_mb ({bucket_bytes} B)")
        for m in metas:
            got[m.name] = got.get(m.name, 0) + m.span
    for name, dt, shape in manifest:
        want = math.prod(shape) * B.dtype_size(dt)
        if got.get(name) != want:
            raise CheckError("weight sync", f"{name} {shape}: the bucket plan carries {got.get(name, 0)} of {want} bytes")
    return len(plan), max(math.prod(s) * B.dtype_size(d) for _, d, s in manifest)


def check_placement(fleet, nodes: int, gpus_per_node: int) -> list:
    """Every engine's node and GPUs (issue-29a's ``FleetLayout.placement``), inside the node, none shared."""
    try:
        placed = fleet.placement(gpus_per_node)
    except ValueError as e:
        raise CheckError("engine placement", str(e)) from None
    for p in placed:
        if not 0 <= p.node <= p.node_ids[-1] < nodes or any(not 0 <= g < gpus_per_node for g in p.gpus):
            raise CheckError("engine placement", f"engine {p.engine} placed on node(s) {_nodes(p)} GPUs {p.gpus}, "
                                                 f"outside {nodes} x {gpus_per_node}")
    return list(placed)


def _nodes(p) -> str:
    return str(p.node) if p.nodes == 1 else f"{p.node}-{p.node_ids[-1]}"


def check_pool_placement(pools, nodes: int, gpus_per_node: int) -> list:
    """Disaggregated: every engine's node and GPUs (``PoolLayout.placement``), inside the node, none shared,
    and none on a GPU of the training pool (global GPU ``node x gpus_per_node + gpu`` >= T)."""
    placed = check_placement(pools, nodes, gpus_per_node)
    for p in placed:
        shared = [(n, g) for n in p.node_ids for g in p.gpus if n * gpus_per_node + g < pools.trainer_world]
        if shared:
            raise CheckError("engine placement", f"engine {p.engine} on node {shared[0][0]} GPU {shared[0][1]} shares "
                                                 f"a GPU of the training pool (ranks 0-{pools.trainer_world - 1})")
    return placed


def check_memory(plan, counts: list[RankCounts], planned: tuple[float, float], cfg) -> dict[str, float]:
    """The planner's parameters per GPU and offload bytes vs the built ranks'; the plan must fit.

    Returns the offloaded bytes per category computed from the built (worst) rank.
    """
    from megatron_maspo.launch.plan.memory import category_bytes, offloaded_bytes

    worst = max(counts, key=lambda c: c.dense + c.expert)
    p_dense, p_expert = planned
    if (round(p_dense), round(p_expert)) != (worst.dense, worst.expert):
        raise CheckError("memory plan", f"the planner counts {p_dense:.0f} dense + {p_expert:.0f} expert parameters on "
                                        f"the largest rank, the built model holds {worst.dense} + {worst.expert}")
    if not plan.fits:
        raise CheckError("memory plan", "the planner refuses the layout: " + "; ".join(plan.reasons))
    mem = plan.memory
    elt = 2 if cfg.model.bf16 else 4  # the trainer's parameter dtype (an fp32 router is the planner's rounding)
    ref = mem.reference > 0
    # grads / optimizer per parameter as the planner's own ratios (its accounting), applied to built counts
    total = worst.dense + worst.expert
    gib = 2**30
    built = category_bytes(weights=total * elt, reference=total * elt if ref else 0.0,
                           grads=total * 4, optimizer=mem.optimizer * gib)
    off = offloaded_bytes(built, params=cfg.train.offload_params, grads=cfg.train.offload_grads,
                          optimizer=cfg.train.offload_optimizer)
    for cat, b in off.items():
        planned_b = mem.offloaded.get(cat, 0.0) * gib
        if abs(planned_b - b) > max(1.0, 1e-9 * b):
            raise CheckError("offload", f"category {cat!r}: the planner offloads {planned_b:.0f} B per GPU, the "
                                        f"built rank {b:.0f} B")
    return off
