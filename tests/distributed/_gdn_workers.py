"""Shared pieces of the Gated DeltaNet tests: a seeded transformers ``Qwen3_5GatedDeltaNet`` (the
reference, run one sequence at a time because it ignores ``cu_seqlens``), the trainer's
``GatedDeltaNet`` loaded with its weights at any TP size, and one packed forward+backward.

Gradients are compared under HF's names, the trainer's gathered over TP and mapped back through
``model/gdn_layout.py``.
"""

from __future__ import annotations

from typing import Any

import torch

LENS = (13, 3, 21)
"""Three unequal sequences: none a multiple of ``CHUNK``, one shorter than the conv kernel (4)."""
CHUNK = 8
HIDDEN = 32
SEED = 5


def hf_config(**overrides: Any) -> Any:
    from transformers import Qwen3_5TextConfig

    kw = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
              layer_types=["linear_attention"], hidden_act="silu", vocab_size=64, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, intermediate_size=64)
    return Qwen3_5TextConfig(**{**kw, **overrides})


def hf_layer(seed: int = SEED) -> Any:
    """A seeded fp32 HF GDN layer; every parameter drawn (A_log kept in a realistic range)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = Qwen3_5GatedDeltaNet(hf_config(), 0).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name in ("norm.weight", "dt_bias") else
                    noise.abs().add(0.5).log() if name == "A_log" else 0.2 * noise)
    return layer


def inputs(seed: int = SEED + 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed hidden ``[T, HIDDEN]``, output weights ``[T, HIDDEN]`` defining the scalar loss)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return torch.randn(t, HIDDEN, generator=gen), torch.randn(t, HIDDEN, generator=gen)


def bounds() -> list[int]:
    out = [0]
    for n in LENS:
        out.append(out[-1] + n)
    return out


def reference() -> dict[str, torch.Tensor]:
    """HF's layer, each sequence alone: output, input gradient and parameter gradients (HF names)."""
    layer = hf_layer()
    x, w = inputs()
    x = x.clone().requires_grad_()
    b = bounds()
    outs = [layer(x[None, lo:hi])[0] for lo, hi in zip(b[:-1], b[1:])]
    out = torch.cat(outs, dim=0)
    (out * w).sum().backward()
    res = {"out": out.detach(), "dx": x.grad.detach()}
    res.update({f"grad/{n}": p.grad.detach().clone() for n, p in layer.named_parameters()})
    return res


def load_trainer(module: Any, layer: Any, dims: Any, tp: int, rank: int) -> None:
    """Copy HF ``layer``'s weights into the trainer's ``module`` (this rank's slices)."""
    from megatron_maspo.model import gdn_layout as L

    sd = dict(layer.named_parameters())
    fused = L.fuse_in_proj(sd["in_proj_qkv.weight"], sd["in_proj_z.weight"], sd["in_proj_b.weight"],
                           sd["in_proj_a.weight"], dims, tp)
    conv = L.fuse_conv(sd["conv1d.weight"], dims, tp)
    nv = dims.num_value_heads // tp
    with torch.no_grad():
        module.in_proj.weight.copy_(fused.chunk(tp, 0)[rank])
        module.conv_weight.copy_(conv.chunk(tp, 0)[rank])
        module.A_log.copy_(sd["A_log"][rank * nv:(rank + 1) * nv])
        module.dt_bias.copy_(sd["dt_bias"][rank * nv:(rank + 1) * nv])
        module.out_norm_weight.copy_(sd["norm.weight"])
        module.out_proj.weight.copy_(sd["out_proj.weight"].chunk(tp, 1)[rank])


def _gather(x: torch.Tensor, dim: int, group: Any, tp: int) -> torch.Tensor:
    import torch.distributed as dist

    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def trainer_run(tp: int, rank: int, group: Any, pg: Any, *, packed: bool = True) -> dict[str, torch.Tensor]:
    """The trainer's GDN at ``tp`` on one packed row (or the unpacked path when all lengths agree):
    output, input gradient and HF-named parameter gradients (gathered over TP)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_maspo.model import gdn_layout as L
    from megatron_maspo.model.gdn import GatedDeltaNet
    from megatron_maspo.model.packed_attention import build_packed_seq_params

    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                            layernorm_epsilon=1e-6, tensor_model_parallel_size=tp)
    dims = L.GdnDims.from_hf(hf_config(), chunk_size=CHUNK, backend="torch")
    module = GatedDeltaNet(cfg, 1, dims, pg_collection=pg)
    layer = hf_layer()
    load_trainer(module, layer, dims, tp, rank)
    x, w = inputs()
    x = x.clone().requires_grad_()
    out, bias = module(x.unsqueeze(1), packed_seq_params=build_packed_seq_params(bounds()))
    assert bias is None
    out = out[:, 0]
    (out * w).sum().backward()
    g = {n: p.grad for n, p in module.named_parameters()}
    qkv, z, b, a = L.split_in_proj(_gather(g["in_proj.weight"], 0, group, tp), dims, tp)
    res = {"out": out.detach(), "dx": x.grad.detach(), "grad/in_proj_qkv.weight": qkv,
           "grad/in_proj_z.weight": z, "grad/in_proj_b.weight": b, "grad/in_proj_a.weight": a,
           "grad/conv1d.weight": L.split_conv(_gather(g["conv_weight"], 0, group, tp), dims, tp),
           "grad/A_log": _gather(g["A_log"], 0, group, tp), "grad/dt_bias": _gather(g["dt_bias"], 0, group, tp),
           "grad/norm.weight": g["out_norm_weight"],
           "grad/out_proj.weight": _gather(g["out_proj.weight"], 1, group, tp)}
    return {k: v.detach().clone() for k, v in res.items()}


def tp_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Spawned rank: Megatron's parallel state at TP = world size, then :func:`trainer_run`."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_maspo.parallel.groups import init_parallel

    init_parallel(tp=world_size, seed=SEED)
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    return trainer_run(world_size, rank, pg.tp, pg)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """``max|a−b| / max(max|b|, 1e-6)`` per key of ``b``."""
    return {k: float((a[k] - v).abs().max() / v.abs().max().clamp_min(1e-6)) for k, v in b.items()}
