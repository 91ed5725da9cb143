"""HF tensors kept by name, unconverted, from import to export (a family's ``passthrough`` prefixes).

GLM-4.5 (and DeepSeek-V3) checkpoints carry multi-token-prediction layers after the decoder, as
``model.layers.{num_hidden_layers + i}.*`` (``num_nextn_predict_layers`` of them). The policy does not
use them (transformers does not build them; nor does the trainer), but a checkpoint exported after RL
should still hold them for speculative decoding. ``hf-to-megatron`` stores them, bytes unchanged, in
``hf_assets/passthrough.safetensors`` of the Megatron checkpoint; ``megatron-to-hf`` writes them back
after the converted tensors. They are not trained and not synced to rollout engines.

A prefix may hold ``{mtp}``: any decoder-layer index at or past ``ArchSpec.num_layers``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_maspo.model.families.registry import get_family
from megatron_maspo.model.spec import ArchSpec

FILE = "passthrough.safetensors"


def _pattern(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix).replace(re.escape("{mtp}"), r"(?P<mtp>\d+)"))


def passthrough_keys(spec: ArchSpec, keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` that ``spec``'s family passes through, sorted."""
    out = []
    for prefix in get_family(spec.family).passthrough:
        pat = _pattern(prefix)
        for k in keys:
            m = pat.match(k)
            if m and ("mtp" not in m.groupdict() or int(m["mtp"]) >= spec.num_layers):
                out.append(k)
    return sorted(set(out))


def save_passthrough(tensors: dict[str, torch.Tensor], assets_dir: str | Path) -> Path | None:
    """Write the passed-through tensors (bytes as read) under ``assets_dir``; None when there are none."""
    if not tensors:
        return None
    from safetensors.torch import save_file

    path = Path(assets_dir) / FILE
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))
    return path


def load_passthrough(assets_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the passed-through tensors stored with a Megatron checkpoint, if any."""
    path = Path(assets_dir) / FILE
    if not path.is_file():
        return
    from safetensors.torch import load_file

    yield from sorted(load_file(str(path)).items())
