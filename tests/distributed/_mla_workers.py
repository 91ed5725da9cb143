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
        chunks = build_model_chunks(spec, ModelBuildOptions(attention_backend=case["backend"]), pp_rank=0)
        try:
            load_hf_weights(chunks, spec, groups, case["hf_dir"])
        except InputError as e:
            out.append({"name": case["name"], "err": None, "refused": str(e)})
            continue
        with torch.no_grad():
            for name, t in chunk_tensors(chunks[0]).items():
                if name.endswith(tuple(case.get("zero", ()))):
                    t.zero_()
        logits = megatron_logits(chunks, spec, groups, case["tokens"])
        out.append({"name": case["name"], "err": max_relative_error(logits, case["ref_logits"]), "refused": None})
    return out
