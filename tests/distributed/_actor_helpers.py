"""Shared pieces for the actor tests: configs, samples, name-based init, full-tensor gathers."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from megatron_maspo.config import MaspoConfig
from megatron_maspo.loss.config import LossConfig
from megatron_maspo.model.config import ModelConfig
from megatron_maspo.model.spec import ArchSpec, tiny_qwen2_spec
from megatron_maspo.parallel.config import ParallelConfig
from megatron_maspo.parallel.groups import ParallelGroups, init_parallel
from megatron_maspo.rollout.config import RolloutConfig
from megatron_maspo.train import components
from megatron_maspo.train.actor.megatron_actor import MegatronActor
from megatron_maspo.train.actor.samples import Sample
from megatron_maspo.train.config import OptimConfig, TrainConfig

VOCAB = 101  # padded to 128·tp: exercises the padded-row masking


def qwen2_spec() -> ArchSpec:
    return tiny_qwen2_spec(VOCAB, num_layers=2, hidden_size=32, tie_word_embeddings=True)


def qwen3_moe_spec() -> ArchSpec:
    return ArchSpec(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64,
                    num_attention_heads=4, num_query_groups=2, kv_channels=8, vocab_size=VOCAB,
                    max_position_embeddings=256, qk_layernorm=True, num_moe_experts=4,
                    moe_ffn_hidden_size=16, moe_router_topk=2, moe_norm_topk_prob=True)


def make_cfg(world: int, tp: int = 1, pp: int = 1, ep: int = 1, *, budget: int = 64,
             mini_batches: int = 2, dist_opt: bool = False, bf16: bool = False, **train_kw) -> MaspoConfig:
    return MaspoConfig(
        model=ModelConfig(bf16=bf16),
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, world_size=world, distributed_optimizer=dist_opt),
        loss=LossConfig(method="maspo"),
        optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        rollout=RolloutConfig(temperature=0.9),
        train=TrainConfig(steps=4, prompts_per_step=4, mini_batches_per_step=mini_batches,
                          max_tokens_per_micro_batch=budget, logprob_chunk_bytes=4096, **train_kw))


def make_samples(n_prompts: int = 4, group: int = 3, seed: int = 0) -> list[Sample]:
    """Uneven prompt and response lengths (so micro-batches hold different token counts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(group):
            n = int(torch.randint(1, 14, (1,), generator=g))
            resp = torch.randint(1, VOCAB, (n,), generator=g).tolist()
            adv = float(torch.randn(1, generator=g))
            out.append(Sample(prompt_ids=prompt.tolist(), response_ids=resp, advantage=adv,
                              prompt_index=p, reward=adv))
    return out


def layer_ids(chunk) -> list[int]:
    """Global 0-based ids of a chunk's decoder layers (Megatron's ``layer_number`` is global, 1-based):
    right for even and uneven pipeline splits alike."""
    model = chunk
    while not hasattr(model, "decoder"):
        model = model.module
    return [layer.layer_number - 1 for layer in model.decoder.layers]


def global_name(name: str, groups: ParallelGroups, spec: ArchSpec, layers: list[int] | None = None) -> str:
    """Layout-independent parameter name (global layer and expert ids, tied output = embedding).

    ``layers``: the chunk's :func:`layer_ids`; None = an even pipeline split."""
    if name == "output_layer.weight" and spec.tie_word_embeddings:
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        local = int(parts[2])
        parts[2] = str(layers[local] if layers is not None else local + groups.pp_rank * (spec.num_layers // groups.pp))
    if "local_experts" in parts:
        k = parts.index("local_experts") + 1
        parts[k] = str(int(parts[k]) + groups.ep_rank * (spec.num_moe_experts // groups.ep))
    return ".".join(parts)


def _tp_split(name: str, p: torch.Tensor, groups: ParallelGroups) -> bool:
    """Whether ``p`` is split over TP: Megatron marks expert linears ``tensor_model_parallel`` too, but
    routed experts are split over expert TP, which is 1 here (model/moe.py); shared experts follow TP."""
    return getattr(p, "tensor_model_parallel", False) and groups.tp > 1 and "local_experts" not in name


def _shard(name: str, full: torch.Tensor, p, groups: ParallelGroups) -> torch.Tensor:
    dim, r, t = p.partition_dim, groups.tp_rank, groups.tp
    if "linear_fc1" in name:  # Megatron keeps [gate_local; up_local] per TP rank
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(t, dim=dim)[r], up.chunk(t, dim=dim)[r]], dim=dim)
    return full.chunk(t, dim=dim)[r]


def _merge(name: str, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    if "linear_fc1" in name:
        halves = [x.chunk(2, dim=dim) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def name_init(spec: ArchSpec, groups: ParallelGroups, seed: int = 7):
    """``init_weights`` callback: every parameter's full value depends only on its global name."""

    def init(chunks: list) -> None:
        for m in chunks:
            ids = layer_ids(m)
            for name, p in m.named_parameters():
                gname = global_name(name, groups, spec, ids)
                shape = list(p.shape)
                split = _tp_split(name, p, groups)
                if split:
                    shape[p.partition_dim] *= groups.tp
                if gname == "embedding.word_embeddings.weight":
                    shape[0] = p.shape[0] * groups.tp  # row-major draw: valid rows equal at any TP
                g = torch.Generator().manual_seed(zlib.crc32(gname.encode()) + seed)
                full = torch.randn(shape, generator=g) * 0.1
                if "norm" in name:
                    full = 1.0 + full
                with torch.no_grad():
                    p.copy_(_shard(name, full, p, groups) if split else full)

    return init


def _gather_sharded_grads(actor: MegatronActor) -> None:
    """Distributed optimizer: after the reduce-scatter each DP rank holds only its shard of every
    bucket's reduced grads (the rest is its local partial sum); all-gather the shards in place so
    every ``main_grad`` is the reduced one. Harmless for the step: each rank reads its own shard."""
    for c in actor.chunks:
        for bg in c.bucket_groups + c.expert_parallel_bucket_groups:
            group = bg.intra_distributed_optimizer_instance_group
            n, r = group.size(), group.rank()
            for bucket in bg.buckets:
                own = bucket.grad_data.view(n, -1)[r].clone()
                dist.all_gather_into_tensor(bucket.grad_data, own, group=group)


def full_tensors(actor: MegatronActor, *, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its main_grad) merged over TP/EP/PP, keyed by global name, on all ranks."""
    groups, spec = actor.groups, actor.spec
    if grads and actor.parallel_cfg.distributed_optimizer and groups.dp > 1:
        _gather_sharded_grads(actor)
    local: dict[str, torch.Tensor] = {}
    for c in actor.chunks:
        ids = layer_ids(c)
        for name, p in c.module.named_parameters():
            t = (p.main_grad if grads else p.data).detach().float().clone()
            if _tp_split(name, p, groups):
                parts = [torch.empty_like(t) for _ in range(groups.tp)]
                dist.all_gather(parts, t.contiguous(), group=groups.tp_group)
                t = _merge(name, parts, p.partition_dim)
            gname = global_name(name, groups, spec, ids)
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue
            if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[:spec.vocab_size]  # padded vocab rows: 128·tp of them
            local[gname] = t
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    out: dict[str, torch.Tensor] = {}
    for d in everything:
        for k, v in d.items():
            out.setdefault(k, v)
    return out


def build_actor(world: int, tp: int = 1, pp: int = 1, ep: int = 1, *, spec: ArchSpec | None = None,
                **cfg_kw) -> MegatronActor:
    spec = spec or qwen2_spec()
    groups = init_parallel(tp=tp, pp=pp, ep=ep, seed=11)
    cfg = make_cfg(world, tp, pp, ep, **cfg_kw)
    return components.build_actor(cfg, spec, groups, init_weights=name_init(spec, groups))
