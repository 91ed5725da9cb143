"""Rank functions for test_mla.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
from megatron_maspo.conversion.plan import chunk_tensors
from megatron_maspo.conversion.verify import max_relative_error, megatron_logits
from megatron_maspo.errors import InputError
from megatron_maspo.model.hf_config import arch_spec_from_hf
from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
from megatron_maspo.parallel.groups import init_parallel


def ablation_errors(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case: load ``hf_dir`` into a TP 1 model built from its spec with ``ablate`` fields replaced,
    then zero the Megatron tensors whose names end in one of ``zero``; the logits error against
    ``ref_logits`` (or the load error's message when the ablated spec cannot hold the checkpoint's tensors)."""
    groups = init_parallel(tp=1, pp=1, ep=1)
    out = []
    for case in cases:
        spec = dataclasses.replace(arch_spec_from_hf(case["hf_dir"]), **case["ablate"])
        try:  # a model this megatron-core cannot build (ValueError) or a checkpoint it cannot hold
            chunks = build_model_chunks(spec, ModelBuildOptions(attention_backend=case["backend"]), pp_rank=0)
            load_hf_weights(chunks, spec, groups, case["hf_dir"])
        except (InputError, ValueError) as e:
            out.append({"name": case["name"], "err": None, "refused": str(e)})
            continue
        with torch.no_grad():
            for name, t in chunk_tensors(chunks[0]).items():
                if name.endswith(tuple(case.get("zero", ()))):
                    t.zero_()
        logits = megatron_logits(chunks, spec, groups, case["tokens"])
        out.append({"name": case["name"], "err": max_relative_error(logits, case["ref_logits"]), "refused": None})
    return out


def packed_logprob_grads(rank: int, world: int, hf_dir: str, seqs: list[list[int]], tp: int = 1) -> dict:
    """The trainer's path at TP ``tp``: the sequences packed into one thd row (positions restarting, per-sequence
    causal attention, cu_seqlens), loss = -sum of next-token log-probs, backward; the gradients exported
    under their HF names (each parameter's gradient put in its place, then the conversion export)."""
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.packed_attention import build_packed_seq_params

    groups = init_parallel(tp=tp, pp=1, ep=1)
    spec = arch_spec_from_hf(hf_dir)
    (model,) = build_model_chunks(spec, ModelBuildOptions(tp=tp), pp_rank=0)
    load_hf_weights([model], spec, groups, hf_dir)
    bounds = [0]
    for s in seqs:
        bounds.append(bounds[-1] + len(s))
    tokens = torch.tensor([t for s in seqs for t in s]).view(1, -1)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).view(1, -1)
    logits = model(tokens, pos, None, packed_seq_params=build_packed_seq_params(bounds))[0]
    if tp > 1:  # vocab-parallel logits: the full row (all-gather's backward hands each rank its slice)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    logits = logits[:, :spec.vocab_size]
    lp = torch.log_softmax(logits.float(), dim=-1)
    per_seq = [lp[a:b - 1].gather(1, tokens[0, a + 1:b].view(-1, 1)).squeeze(1) for a, b in zip(bounds[:-1], bounds[1:])]
    loss = -torch.cat(per_seq).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads = {k: v for k, v in export_hf_weights([model], spec, groups) if "e_score_correction_bias" not in k}
    return {"loss": float(loss), "logprobs": [x.detach() for x in per_seq], "grads": grads}
