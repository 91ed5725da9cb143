"""HF tensors kept by name from import to export, unconverted (a family's ``passthrough`` prefixes).

DeepSeek-V3's multi-token-prediction layers (``model.layers.{L}.*`` .. ``model.layers.{L+n-1}.*`` for
``L = num_hidden_layers`` and ``n = num_nextn_predict_layers``) are not part of the Megatron model the
RL trainer builds. ``hf-to-megatron`` copies them byte for byte into the checkpoint's ``hf_assets/``
(``passthrough-NNNNN.safetensors``, at most ``max_shard_bytes`` each, so the host holds one shard) and
``megatron-to-hf`` appends them to the export under the same names, so the exported folder keeps what
transformers' ``MtpModel`` (``generate(..., use_mtp=True)``) and vLLM's MTP drafter load.

A prefix holding ``{mtp_layer}`` stands for every MTP layer index; other prefixes are taken as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_maspo.model.families.registry import get_family
from megatron_maspo.model.spec import ArchSpec

MTP_COUNT_KEY = "num_nextn_predict_layers"
"""``ArchSpec.extra`` key of the number of MTP layers (the HF ``config.json`` key)."""
FILE_PATTERN = "passthrough-*.safetensors"


def passthrough_prefixes(spec: ArchSpec) -> tuple[str, ...]:
    """The concrete key prefixes ``spec``'s family passes through."""
    first, n = spec.num_layers, int(spec.extra.get(MTP_COUNT_KEY, 0) or 0)
    out: list[str] = []
    for prefix in get_family(spec.family).passthrough:
        out += [prefix.format(mtp_layer=i) for i in range(first, first + n)] if "{mtp_layer}" in prefix \
            else [prefix]
    return tuple(out)


def passthrough_names(spec: ArchSpec, keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` that ``spec`` passes through, sorted."""
    prefixes = passthrough_prefixes(spec)
    return sorted(k for k in keys if prefixes and k.startswith(prefixes))


def save_passthrough(get, names: list[str], out_dir: str | Path, *, max_shard_bytes: int = 2 << 30) -> int:
    """Write ``get(name)`` for every name into ``out_dir/passthrough-NNNNN.safetensors``; returns the count."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    size = files = 0
    for name in names:
        t = get(name).contiguous()
        if shard and size + t.numel() * t.element_size() > max_shard_bytes:
            save_file(shard, str(Path(out_dir) / f"passthrough-{files:05d}.safetensors"))
            shard, size, files = {}, 0, files + 1
        shard[name] = t
        size += t.numel() * t.element_size()
    if shard:
        save_file(shard, str(Path(out_dir) / f"passthrough-{files:05d}.safetensors"))
    return len(names)


def read_passthrough(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors :func:`save_passthrough` wrote under ``folder``, one shard in memory at a time."""
    from safetensors.torch import load_file

    for path in sorted(Path(folder).glob(FILE_PATTERN)):
        yield from sorted(load_file(str(path)).items())


def count_passthrough(folder: str | Path) -> int:
    """How many tensors :func:`read_passthrough` yields (headers only)."""
    from safetensors import safe_open

    n = 0
    for path in Path(folder).glob(FILE_PATTERN):
        with safe_open(str(path), framework="pt") as f:
            n += len(list(f.keys()))
    return n
