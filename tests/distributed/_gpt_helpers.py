"""Shared pieces for distributed Megatron GPT tests: build, run the schedule, gather full grads."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel.groups import ParallelGroups, init_parallel
from tests.distributed._actor_helpers import _merge, global_name, layer_ids, name_init


def make_batches(vocab: int, n_micro: int, b: int, s: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
        mask = (torch.rand(b, s, generator=g) > 0.2).float()
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                    "position_ids": torch.arange(s).expand(b, s).contiguous()})
    return out


def build(spec: ArchSpec, tp: int, pp: int, *, divisible_by: int, seed: int = 7,
          split: tuple[int | None, int | None] = (None, None)):
    """Build the chunks and give every parameter a value that depends only on its global name.

    ``split``: layers of the first and last pipeline stage (None = even)."""
    groups = init_parallel(tp=tp, pp=pp, seed=seed)
    torch.manual_seed(seed)
    opts = ModelBuildOptions(tp=tp, pp=pp, make_vocab_size_divisible_by=divisible_by, pp_first_layers=split[0],
                             pp_last_layers=split[1])
    chunks = build_model_chunks(spec, opts, pp_rank=groups.pp_rank)
    name_init(spec, groups, seed)(chunks)
    return groups, chunks


def run_schedule(chunks: list, batches: list[dict], seq_len: int, micro_b: int) -> list[float]:
    """Forward+backward all micro-batches through Megatron's schedule; CE summed over loss_mask."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(mask, output):
        loss_sum = (output.float() * mask).sum()
        n = mask.sum().to(torch.int)
        return loss_sum, n, {"lm loss": torch.stack([loss_sum.detach().clone(), n.float()])}

    def forward_step(data_iter, model):
        batch = next(data_iter)
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return out, partial(loss_func, batch["loss_mask"])

    for m in chunks:
        m.config.finalize_model_grads_func = None
        m.zero_grad(set_to_none=True)
    fb = get_forward_backward_func()
    losses = fb(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks[0] if
                len(chunks) == 1 else chunks, num_microbatches=len(batches), seq_length=seq_len,
                micro_batch_size=micro_b, forward_only=False)
    return [float(x["lm loss"][0]) for x in losses]


def full_named_grads(chunks: list, groups: ParallelGroups, spec: ArchSpec) -> dict[str, torch.Tensor]:
    """Gather every parameter's gradient to its full (TP-merged) shape, named with global layer ids.

    Valid for layouts built with ``use_cpu_initialization`` (contiguous slices along partition_dim).
    Every rank returns the full dict (PP stages exchange through an all-gather of objects).
    """
    local: dict[str, torch.Tensor] = {}
    for m in chunks:
        ids = layer_ids(m)
        for name, p in m.named_parameters():
            g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            g = torch.zeros_like(p) if g is None else g.detach().clone()
            if getattr(p, "tensor_model_parallel", False) and groups.tp > 1:
                parts = [torch.empty_like(g) for _ in range(groups.tp)]
                dist.all_gather(parts, g.contiguous(), group=groups.tp_group)
                g = _merge(name, parts, p.partition_dim)
            name = global_name(name, groups, spec, ids)
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # PP > 1: the tied copy; its grad was summed into the embedding's
            local[name] = g
    gathered: list = [None] * groups.pp
    dist.all_gather_object(gathered, local, group=groups.pp_group)
    full: dict[str, torch.Tensor] = {}
    for d in gathered:
        for k, v in d.items():
            full.setdefault(k, v)
    return full
