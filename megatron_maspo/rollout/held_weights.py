"""Read back, inside a vLLM worker, the weights it holds for each HF checkpoint name (for :mod:`~.digest`).

vLLM keeps a model in its own layout, not the checkpoint's:

- fused parameters: ``qkv_proj`` = rows of ``q_proj``, ``k_proj``, ``v_proj`` stacked in that order,
  ``gate_up_proj`` = ``gate_proj`` then ``up_proj`` (the model class's ``packed_modules_mapping``);
- vocabulary rows padded (``VocabParallelEmbedding`` rounds the vocabulary up to a multiple of 64);
- on the CPU backend, a linear layer's weight is *removed* after loading (an empty parameter) and lives
  only inside the GEMM closure ``layer.cpu_linear`` (a packed oneDNN / sgl copy); a tied ``lm_head``
  also gets such a closure over a packed copy of the embedding.

So "what the engine holds" is read where the engine computes with it: a parameter's data where it has
some, else the closure itself, probed with the identity: ``cpu_linear(I_K) = I_K W^T = W^T``, exact in
any dtype (each output is one product with 1.0 plus exact zeros). Pure torch (no vllm import): the
worker extension in ``vllm_engine.py`` calls it.

Only vLLM tensor parallelism 1 is read back here (a TP rank holds row or column shards whose place in
the checkpoint tensor depends on the layer type); :func:`held_tensor` says so for TP > 1. Nor are
vLLM's fused MoE experts (``w13_weight`` / ``w2_weight``, mapped by the model's expert mapping, not by
``packed_modules_mapping``): the engine logs how many synced tensors it could not read back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

_PROBE_ROWS = 4096  # identity rows per GEMM probe (bounds the probe's memory for wide layers)


def gemm_weight(module: Any) -> torch.Tensor | None:
    """The ``[N, K]`` weight a CPU GEMM closure (``module.cpu_linear``) multiplies by, probed with the
    identity; None when the module has no closure."""
    fn = module.__dict__.get("cpu_linear")
    if fn is None:
        return None
    weight = module.weight
    k = int(module.input_size) if "input_size" in module.__dict__ else int(module.embedding_dim)
    outs = []
    for start in range(0, k, _PROBE_ROWS):
        rows = min(_PROBE_ROWS, k - start)
        eye = torch.zeros(rows, k, dtype=weight.dtype, device=weight.device)
        eye[:, start:start + rows].fill_diagonal_(1)
        outs.append(fn(eye, weight, None))  # [rows, N] = rows of W^T
    return torch.cat(outs).t()


def held_tensor(model: torch.nn.Module, name: str, shapes: Mapping[str, Sequence[int]],
                packed: Mapping[str, Sequence[str]], *, tp: int = 1) -> torch.Tensor | None:
    """The tensor ``model`` computes with for HF name ``name`` (its checkpoint shape), or None when this
    worker cannot say (vLLM TP > 1, or a name it does not hold).

    Args:
        model: the worker's model.
        name: an HF checkpoint name of the sync.
        shapes: ``{hf_name: shape}`` of every tensor the sync delivered (the siblings of a fused one).
        packed: the model class's ``packed_modules_mapping`` (``{"qkv_proj": ["q_proj", ...]}``).
        tp: the engine's tensor-parallel size.
    """
    if tp != 1:
        return None
    pname, row0 = name, 0
    for fused, parts in packed.items():
        for i, part in enumerate(parts):
            if f".{part}." in name:
                pname = name.replace(f".{part}.", f".{fused}.")
                for earlier in parts[:i]:  # rows of the pieces stacked before this one
                    row0 += int(shapes[name.replace(f".{part}.", f".{earlier}.")][0])
                break
        if pname != name:
            break
    mod_name, _, attr = pname.rpartition(".")
    try:
        module = model.get_submodule(mod_name)
    except AttributeError:
        return None
    param = module._parameters.get(attr)
    if param is None:
        return None
    data = param.data
    if data.numel() == 0 and attr == "weight":  # removed after loading: the GEMM closure holds it
        data = gemm_weight(module)
        if data is None:
            return None
    shape = tuple(int(s) for s in shapes[name])
    return data[row0:row0 + shape[0]].reshape(shape) if data.dim() else data.reshape(shape)


def tied_head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """A tied ``lm_head``'s GEMM weight as its closure holds it (the CPU backend packs a copy of the
    embedding), or None (untied, or no closure: the head reads the embedding parameter itself)."""
    head = model._modules.get("lm_head")
    inner = model._modules.get("model")
    embed = inner._modules.get("embed_tokens") if inner is not None else None
    if head is None or embed is None or head._parameters.get("weight") is not embed._parameters.get("weight"):
        return None
    return gemm_weight(head)
