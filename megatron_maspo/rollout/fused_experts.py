"""Per-expert HF checkpoint names -> the fused expert parameters of transformers >= 5 MoE models.

Checkpoints (and our weight sync, which speaks checkpoint names) hold one tensor per expert:
``<layer>.mlp.experts.<e>.{gate_proj,up_proj,down_proj}.weight``. transformers 5 keeps them fused in
the live module (e.g. ``Qwen3MoeExperts``): ``gate_up_proj [E, 2I, H]`` (gate rows first, then up)
and ``down_proj [E, H, I]``, and converts names only inside ``from_pretrained``. The built-in engine
loads synced tensors into the live module, so it needs the slot of each per-expert tensor.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")


def fused_slot(name: str, params: dict[str, torch.Tensor]) -> tuple[str, tuple] | None:
    """``(fused parameter name, index into it)`` for a per-expert checkpoint name, or None when
    ``name`` is not per-expert or the model keeps experts unfused."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    pre, e, w = m["pre"], int(m["e"]), m["w"]
    if w == "down_proj":
        fused = f"{pre}.down_proj"
        return (fused, (e,)) if fused in params else None
    fused = f"{pre}.gate_up_proj"
    if fused not in params:
        return None
    half = params[fused].shape[1] // 2
    return fused, (e, slice(0, half) if w == "gate_proj" else slice(half, 2 * half))


def pieces_per_fused(name: str, p: torch.Tensor) -> int:
    """How many per-expert tensors fill fused parameter ``name`` (2 per expert for gate_up)."""
    return 2 * p.shape[0] if name.endswith("gate_up_proj") else p.shape[0]
