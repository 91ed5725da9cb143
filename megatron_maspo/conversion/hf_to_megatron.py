"""Load an HF checkpoint (folder or in-memory mapping) into Megatron-Core ``GPTModel`` chunks.

Each rank reads lazily (``safetensors.safe_open``) only the HF tensors its chunks need, one mapping
at a time, so the host memory beyond the model shard is about one tensor (the largest is the
embedding). The key set and every shape are checked against the spec BEFORE any parameter is
touched, so a bad checkpoint fails with the offending tensor's name and leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_maspo.conversion import hybrid_shard
from megatron_maspo.conversion.mapping import QKV, Direct, Entry, GatedMLP
from megatron_maspo.conversion.plan import (
    chunk_tensors,
    hf_shape,
    hf_state_dict_keys,
    local_items,
    mcore_names,
    resolve,
)
from megatron_maspo.conversion.shard import (
    gated_shard,
    pad_vocab,
    qkv_shard,
    rope_block,
    rope_rows_to_megatron,
    tp_shard,
)
from megatron_maspo.conversion.validate import safetensors_files
from megatron_maspo.errors import InputError
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)


class HFSource(contextlib.AbstractContextManager):
    """Uniform read access to an HF folder (lazy safetensors) or a ``Mapping[str, Tensor]``."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor]):
        self._stack = contextlib.ExitStack()
        self._files: dict[str, object] = {}
        if isinstance(source, Mapping):
            self._mapping: Mapping[str, torch.Tensor] | None = source
            return
        self._mapping = None
        self._paths: dict[str, Path] = {}
        from safetensors import SafetensorError, safe_open

        for path in safetensors_files(source)[0]:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as e:  # the library's message names neither the file nor the folder
                self._stack.close()
                raise InputError(f"{path}: unreadable safetensors file ({e})") from None
            for key in handle.keys():  # noqa: SIM118 (safe_open handle, not a dict)
                if key in self._files:
                    raise InputError(f"{path}: HF tensor {key!r} is also in {self._paths[key].name}")
                self._files[key], self._paths[key] = handle, path

    def keys(self) -> set[str]:
        return set(self._mapping) if self._mapping is not None else set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mapping is not None:
            return tuple(self._mapping[name].shape)
        return tuple(self._files[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if self._mapping is not None:
            return self._mapping[name]
        from safetensors import SafetensorError

        try:
            return self._files[name].get_tensor(name)
        except SafetensorError as e:
            raise InputError(f"{self._paths[name]}: cannot read tensor {name!r} ({e})") from None

    def where(self, name: str) -> str:
        """The file holding ``name`` (``<memory>`` for a mapping), for error messages."""
        return "<memory>" if self._mapping is not None else str(self._paths.get(name, "?"))

    def __exit__(self, *exc) -> None:
        self._stack.close()


def check_hf_keys(src: HFSource, spec: ArchSpec) -> None:
    """Exact key-set and shape check of ``src`` against ``spec``; ``InputError`` names the tensors."""
    from megatron_maspo.conversion.passthrough import passthrough_keys

    expected = hf_state_dict_keys(spec)
    got = src.keys() - set(passthrough_keys(spec, src.keys()))  # kept by name (MTP layers), not converted
    missing = [k for k in expected if k not in got]
    extra = sorted(got - set(expected))
    if missing or extra:
        raise InputError(f"HF checkpoint does not match the {spec.family} spec: missing tensors "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected tensors "
                         f"{extra[:8]}{' ...' if len(extra) > 8 else ''}")
    for k in expected:
        if src.shape(k) != (want := hf_shape(k, spec)):
            raise InputError(f"{src.where(k)}: HF tensor {k!r} has shape {src.shape(k)}, expected {want} "
                             "for this spec")


def _megatron_shard(entry: Entry, hf: list[torch.Tensor], spec: ArchSpec, tp: int, rank: int,
                    padded_rows: int | None) -> torch.Tensor:
    """This TP rank's Megatron tensor built from the entry's full HF tensors."""
    if isinstance(entry, QKV):
        return qkv_shard(*hf, spec.num_attention_heads, spec.num_query_groups, tp, rank)
    if isinstance(entry, GatedMLP):
        return gated_shard(hf[0], hf[1], tp, rank)
    if isinstance(entry, hybrid_shard.HYBRID_ENTRIES):
        return hybrid_shard.shard(entry, hf, spec, tp, rank)
    assert isinstance(entry, Direct)
    full = pad_vocab(hf[0], padded_rows) if entry.vocab and padded_rows else hf[0]
    if reorder := rope_block(entry.rope_rows, spec, full.shape[0]):
        full = rope_rows_to_megatron(full, *reorder)
    return tp_shard(full, entry.split, tp, rank)


def _tp_of(groups: ParallelGroups, expert: int | None) -> tuple[int, int]:
    # Expert tensors use the expert-TP group; MoE runs at expert TP = 1 here (spec.validate_layout).
    return (1, 0) if expert is not None else (groups.tp, groups.tp_rank)


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], spec: ArchSpec, groups: ParallelGroups,
                    source: str | Path | Mapping[str, torch.Tensor]) -> None:
    """Copy an HF checkpoint into this rank's Megatron chunks (TP/PP/EP slicing, vocab padding).

    Args:
        chunks: this rank's ``GPTModel`` chunks (possibly DDP/Float16Module-wrapped), as built by
            ``build_model_chunks`` for ``spec`` at the layout of ``groups``.
        spec: the architecture (``arch_spec_from_hf`` of the same checkpoint).
        groups: this rank's parallel layout (only sizes/ranks are used; no collective runs).
        source: an HF folder (``*.safetensors`` [+ index]) or a mapping of HF key -> full tensor.

    Padded vocab rows (``Vp - V``) are zero. Tied embeddings: with PP > 1 the last stage's
    duplicate ``output_layer.weight`` is filled from ``model.embed_tokens.weight`` too.

    Raises:
        ValueError: missing/extra HF tensors, a shape mismatch, or a Megatron parameter no mapping
            covers (each names the tensor).
    """
    with HFSource(source) if not isinstance(source, HFSource) else contextlib.nullcontext(source) as src:
        check_hf_keys(src, spec)
        plans = []
        for chunk in chunks:  # plan everything first: a table error leaves the model untouched
            params = chunk_tensors(chunk)
            plan, used = [], set()
            for item, local_layer in local_items(chunk, spec):
                for mname, expert in mcore_names(item, local_layer, spec, groups.ep, groups.ep_rank):
                    key = resolve(params, mname)
                    hf = [n.format(layer=item.layer, expert=expert) if "{" in n else n
                          for n in item.entry.hf_names]
                    plan.append((item.entry, hf, params[key], key, expert))
                    used.add(key)
            if "output_layer.weight" in params and spec.tie_word_embeddings:
                # PP > 1 tied: the last stage's duplicate of the embedding (conversion-rules.md §7).
                tied = Direct("model.embed_tokens.weight", "output_layer.weight", split=0, vocab=True)
                plan.append((tied, [tied.hf], params["output_layer.weight"], "output_layer.weight", None))
                used.add("output_layer.weight")
            if leftover := sorted(set(params) - used):
                raise ValueError(f"Megatron parameters not covered by the {spec.family} table: {leftover}")
            plans.append(plan)
        for plan in plans:
            for entry, hf_names, param, key, expert in plan:
                tp, rank = _tp_of(groups, expert)
                padded = param.shape[0] * tp if isinstance(entry, Direct) and entry.vocab else None
                shard = _megatron_shard(entry, [src.get(n) for n in hf_names], spec, tp, rank, padded)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"Megatron parameter {key!r} has shape {tuple(param.shape)} but "
                                     f"{hf_names} give {tuple(shard.shape)} at TP rank {rank}/{tp}")
                param.copy_(shard)
    logger.info("loaded HF weights into %d chunk(s) (%s)", len(chunks), groups.describe())
