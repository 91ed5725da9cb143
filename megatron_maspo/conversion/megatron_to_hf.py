"""Stream full HF-named tensors out of Megatron-Core chunks (export and rollout weight sync).

:func:`export_hf_weights` is a collective generator: every rank of the model (all TP, PP and EP
ranks) iterates it in lockstep and receives every tensor. Per mapping it all-gathers TP shards
(and EP expert stacks) on the owning stage, converts to HF layout there and broadcasts to the other
stages; receivers know shapes from the spec and dtypes from a per-call manifest. The plan (which
stage owns what) is rebuilt on every call, so it cannot go stale after offload or resharding
(NovaSky-AI/SkyRL #1345). Host memory beyond the model shard is one mapping (for MoE: one layer's
experts of one kind).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_maspo.conversion import hybrid_shard
from megatron_maspo.conversion.mapping import QKV, Direct, GatedMLP, fill, is_expert
from megatron_maspo.conversion.plan import (
    Item,
    chunk_layers,
    chunk_tensors,
    global_items,
    hf_shape,
    mcore_names,
    resolve,
    unwrap,
)
from megatron_maspo.conversion.shard import (
    gated_merge,
    qkv_merge,
    rope_block,
    rope_rows_to_hf,
    tp_merge,
    unpad_vocab,
)
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel import comm
from megatron_maspo.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


def _manifest(chunks: list[torch.nn.Module], groups: ParallelGroups) -> list[dict]:
    """Per PP stage: does it hold the embedding / the head, its global layers, its param dtype."""
    models = [unwrap(c) for c in chunks]
    dtypes = {p.dtype for m in models for p in m.parameters()}
    mine = {"pre": any(m.pre_process for m in models), "post": any(m.post_process for m in models),
            "layers": [i for m in models for i in chunk_layers(m)],
            "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None}
    if groups.pp == 1:
        return [mine]
    # staged on the parameters' GPU (the group's), not the calling thread's current device: the sync runs
    # this in its prefetch thread, which would otherwise stage on cuda:0 (issue 29, defect 4)
    device = next((p.device for m in models for p in m.parameters()), None)
    return comm.all_gather_object(mine, group=groups.pp_group, device=device)


def _gather(t: torch.Tensor, n: int, group) -> list[torch.Tensor]:
    if n == 1:
        return [t]
    return comm.all_gather(t, group=group)


def _to_hf(item: Item, parts: list[torch.Tensor], spec: ArchSpec) -> list[torch.Tensor]:
    """Full HF tensors (entry order) from all TP ranks' shards of one Megatron tensor."""
    e = item.entry
    if isinstance(e, QKV):
        return list(qkv_merge(parts, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels))
    if isinstance(e, GatedMLP):
        return list(gated_merge(parts))
    if isinstance(e, hybrid_shard.HYBRID_ENTRIES):
        return hybrid_shard.merge(e, parts, spec)
    assert isinstance(e, Direct)
    full = tp_merge(parts, e.split)
    if reorder := rope_block(e.rope_rows, spec, full.shape[0]):
        full = rope_rows_to_hf(full, *reorder)
    return [unpad_vocab(full, spec.vocab_size) if e.vocab else full]


def _owned_tensors(item: Item, params: dict, local_layer: int | None, spec: ArchSpec,
                   groups: ParallelGroups, dtype: torch.dtype) -> list[torch.Tensor]:
    """On the owning stage: the item's full HF tensors in ``item.hf_names`` order."""
    names = mcore_names(item, local_layer, spec, groups.ep, groups.ep_rank)
    if not is_expert(item.entry):
        local = params[resolve(params, names[0][0])].detach()
        parts = _gather(local, groups.tp if item.entry.split is not None else 1, groups.tp_group)
        keep = torch.float32 if getattr(item.entry, "fp32", False) else dtype
        return [t.to(keep) for t in _to_hf(item, parts, spec)]
    # Experts: stack this EP rank's experts, gather the stacks (EP rank order = global expert order).
    local = torch.stack([params[resolve(params, n)].detach() for n, _ in names])
    experts = torch.cat(_gather(local, groups.ep, groups.ep_group), dim=0)
    # expert TP is 1 here (MoE needs TP = 1 on the local spec): each expert is one full shard.
    return [t.to(dtype) for ex in experts for t in _to_hf(item, [ex], spec)]


@torch.no_grad()
def export_hf_weights(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups, *,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, full_tensor)`` for the whole model, on every rank, in a fixed global order.

    Collective: all ranks of the TP, PP and EP groups must iterate it to the end in lockstep.
    Tensors are full (TP-gathered, EP-gathered, broadcast from the owning PP stage), named like the
    HF safetensors checkpoint, vocab padding sliced off (``[V, H]``), the tied embedding yielded once
    as ``model.embed_tokens.weight`` (no ``lm_head.weight``). Yielded tensors are fresh buffers the
    caller may keep. The plan is rebuilt on each call.

    Args:
        chunks: this rank's ``GPTModel`` chunks (wrappers are stripped).
        spec: the architecture the chunks were built from.
        groups: this rank's parallel groups.
        dtype: cast to this dtype on the owning stage (before any broadcast); None keeps the
            parameters' dtype.
    """
    manifest = _manifest(chunks, groups)
    wire = dtype
    if wire is None:
        stage_dtypes = {m["dtype"] for m in manifest}
        if len(stage_dtypes) != 1 or None in stage_dtypes:
            raise ValueError(f"export_hf_weights: parameters have mixed dtypes {stage_dtypes} across "
                             "the model; pass dtype=")
        wire = getattr(torch, stage_dtypes.pop())
    owner_pre = next(s for s, m in enumerate(manifest) if m["pre"])
    owner_post = next(s for s, m in enumerate(manifest) if m["post"])
    owner_layer = {layer: s for s, m in enumerate(manifest) for layer in m["layers"]}
    if sorted(owner_layer) != list(range(spec.num_layers)):
        raise ValueError(f"model chunks hold layers {sorted(owner_layer)}; spec has {spec.num_layers}")
    # Where each of my global layers lives: (params of its chunk, stage-local index).
    local: dict[int, tuple[dict, int]] = {}
    for chunk in chunks:
        params = chunk_tensors(chunk)
        for i, layer in enumerate(chunk_layers(chunk)):
            local[layer] = (params, i)
    models = [unwrap(c) for c in chunks]
    device = next(models[0].parameters()).device
    first = chunk_tensors(models[0])
    last = chunk_tensors(models[-1])
    for item in global_items(spec):
        owner = {"pre": owner_pre, "post": owner_post}.get(item.section) if item.layer is None \
            else owner_layer[item.layer]
        names = item.hf_names(spec)
        if owner == groups.pp_rank:
            if item.layer is None:
                params, local_layer = (first if item.section == "pre" else last), None
            else:
                params, local_layer = local[item.layer]
            tensors = _owned_tensors(item, params, local_layer, spec, groups, wire)
        else:
            # receive buffers where the owner's tensors are: the parameters' device
            tensors = [torch.empty(hf_shape(n, spec), dtype=torch.float32 if getattr(item.entry, "fp32", False)
                                   else wire, device=device) for n in names]
        if groups.pp > 1:
            src = dist.get_global_rank(groups.pp_group, owner)
            for t in tensors:
                comm.broadcast(t, src=src, group=groups.pp_group)
        yield from zip(names, tensors, strict=True)


@torch.no_grad()
def export_owned_weights(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups,
                         sender_of: Mapping[str, int], rank: int, *,
                         dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield, on ``rank``, the full HF tensors ``sender_of`` assigns to it, in the global order.

    The sharded counterpart of :func:`export_hf_weights` (``rollout/transfer_plan.py`` makes
    ``sender_of``: HF name -> the global rank that sends it). No PP broadcast and no EP gather: a dense
    tensor's TP shards are all-gathered inside the TP group of its sender (the ranks ``sender ..
    sender + tp - 1``, tp-fastest order), experts are converted where they live (whole on every rank at
    any TP: expert TP is 1), with no collective. Every rank of the model iterates it; ranks outside a
    sending TP group do nothing for that tensor.

    Raises:
        ValueError: this rank holds a tensor the plan gives it, but under other names (plan and chunks
            disagree on the layout).
    """
    models = [unwrap(c) for c in chunks]
    local: dict[int, tuple[dict, int]] = {}
    for chunk in chunks:
        params = dict(unwrap(chunk).named_parameters())
        for i, layer in enumerate(chunk_layers(chunk)):
            local[layer] = (params, i)
    held = {"pre": (dict(models[0].named_parameters()) if any(m.pre_process for m in models) else None),
            "post": (dict(models[-1].named_parameters()) if any(m.post_process for m in models) else None)}
    my_group = rank - groups.tp_rank  # first rank of my TP group
    for item in global_items(spec):
        if item.layer is None:
            params, local_layer = held[item.section], None
        else:
            params, local_layer = local.get(item.layer, (None, None))
        if params is None:
            continue  # another stage's
        names = item.hf_names(spec)
        if not is_expert(item.entry):
            src = sender_of[names[0]]
            if src != my_group:
                continue  # another replica (DP, CP) sends it
            shard = params[resolve(params, mcore_names(item, local_layer, spec, 1, 0)[0][0])].detach()
            parts = _gather(shard, groups.tp if item.entry.split is not None else 1, groups.tp_group)
            if rank == src:
                wire = dtype or shard.dtype
                yield from zip(names, (t.to(wire) for t in _to_hf(item, parts, spec)), strict=True)
            continue
        mine = [n for n in names if sender_of[n] == rank]
        if not mine:
            continue
        # whole experts at any TP: parallel/groups.py builds Megatron with expert TP 1, so every rank of an
        # EP rank's expert-DP replicas holds its experts unsplit (no gather, no collective here)
        out: list[tuple[str, torch.Tensor]] = []
        for mname, expert in mcore_names(item, local_layer, spec, groups.ep, groups.ep_rank):
            t = params[resolve(params, mname)].detach()
            hf = [fill(n, layer=item.layer, expert=expert) for n in item.entry.hf_names]
            out += zip(hf, (x.to(dtype or t.dtype) for x in _to_hf(item, [t], spec)), strict=True)
        if [n for n, _ in out] != mine:
            raise ValueError(f"export: rank {rank} (EP rank {groups.ep_rank}) holds experts {[n for n, _ in out][:2]}..."
                             f" but the transfer plan gives it {mine[:2]}...")
        yield from out


def save_hf_folder(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, config: dict, *,
                   max_shard_bytes: int = 2 << 30, copy_from: str | Path | None = None,
                   progress: bool = True, total: int | None = None) -> Path:
    """Stream tensors into an HF folder (``*.safetensors`` shards + index + ``config.json``).

    Written into a sibling temporary folder and renamed at the end: an error never leaves a partial
    checkpoint at ``out_dir`` (which must not exist). Only ``max_shard_bytes`` of tensors are held.
    ``copy_from``: a folder whose tokenizer/generation files are copied along.
    ``total``: the number of tensors ``named`` yields, for the progress bar (when known).
    """
    import json

    from safetensors.torch import save_file
    from tqdm import tqdm

    from megatron_maspo.model.checkpoint import atomic_dir

    with atomic_dir(out_dir) as tmp:
        shards: list[list[str]] = []
        buf: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            nonlocal buf, size
            if buf:
                save_file(buf, str(tmp / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shards.append(list(buf))
                buf, size = {}, 0

        for name, t in tqdm(named, desc="export", unit=" tensors", total=total, disable=not progress):
            nbytes = t.numel() * t.element_size()
            if buf and size + nbytes > max_shard_bytes:
                flush()
            buf[name] = t.to("cpu").contiguous()  # shards are buffered on the host, not the GPU
            size += nbytes
            total += nbytes
        flush()
        n = len(shards)
        files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                       for i in range(n)]
        for i, fname in enumerate(files):
            (tmp / f"part-{i:05d}.safetensors").rename(tmp / fname)
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: files[i] for i, keys in enumerate(shards) for k in keys}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if copy_from is not None:
            copy_hf_assets(copy_from, tmp)
    return Path(out_dir)


HF_ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
                  "added_tokens.json")


def copy_hf_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer and generation-config files (whichever exist) from ``src`` to ``dst``."""
    import shutil

    copied = []
    for name in HF_ASSET_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
