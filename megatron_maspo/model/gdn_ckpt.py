"""Distributed-checkpoint sharding of the trainer's Gated DeltaNet, independent of the TP size.

A rank's fused ``in_proj`` slice is ``[q_r | k_r | v_r | z_r | b_r | a_r]`` and its conv slice
``[q_r | k_r | v_r]`` (``gdn.py``), so one contiguous TP shard of the fused tensor would mean
different things at different TP sizes. The checkpoint stores each part as its own tensor
(``in_proj.weight.q`` ... ``.a``, ``conv_weight.q`` ... ``.v``), each split over TP by heads: a
checkpoint written at TP 2 loads at TP 1 or 4 (Megatron's own GDN does the same). ``A_log`` and
``dt_bias`` are split over TP along the value heads; the norm weight is replicated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

IN_PROJ_PARTS = ("q", "k", "v", "z", "b", "a")


def _split_factory(sh_ten: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A factory storing ``sh_ten`` (TP-sharded on dim 0) as one TP-sharded tensor per part."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    template = sh_ten.without_data()
    if sum(sizes) != template.local_shape[0]:
        raise ValueError(f"GDN checkpoint parts {sizes} do not cover the {template.local_shape[0]} local rows")

    @torch.no_grad()
    def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> list:
        whole = replace(template, key=key, data=t, dtype=t.dtype, replica_id=replica_id,
                        flattened_range=flattened_range)
        out, start = [], 0
        for size, name in zip(sizes, names):
            for part in whole.narrow(0, start, size):
                part.key = f"{part.key}.{name}"
                out.append(part)
            start += size
        return out

    @torch.no_grad()
    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id)  # type: ignore[arg-type]


def gdn_sharded_state_dict(module: Any, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
    """``GatedDeltaNet.sharded_state_dict``: own parameters, the two projections, fused parts split."""
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
        sharded_state_dict_default,
    )

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    own: dict = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(own, prefix, {"conv_weight": 0, "A_log": 0, "dt_bias": 0},
                                              sharded_offsets, tp_group=module.tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                              tp_group=module.tp_group))
    key = f"{prefix}in_proj.weight"
    out[key] = _split_factory(out[key], module.parts, IN_PROJ_PARTS)
    key = f"{prefix}conv_weight"
    out[key] = _split_factory(out[key], module.parts[:3], IN_PROJ_PARTS[:3])
    return out
