"""Rank functions for test_conversion_parity.py (module-level so spawn can pickle them)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_maspo.conversion import hf_state_dict_keys
from megatron_maspo.conversion.dist_ckpt import load_model_checkpoint, save_model_checkpoint
from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
from megatron_maspo.conversion.verify import max_relative_error, megatron_logits
from megatron_maspo.model.hf_config import arch_spec_from_hf
from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
from megatron_maspo.parallel.groups import init_parallel


def _digest(named) -> tuple[list[str], str]:
    h = hashlib.sha256()
    names = []
    for name, t in named:
        names.append(name)
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return names, h.hexdigest()


def parity_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case: load HF weights at (tp, pp, ep), compare logits, export, optional dist ckpt."""
    out, layout, groups = [], None, None
    for case in cases:  # callers sort cases by layout: one init_parallel (group creation) per layout
        spec = arch_spec_from_hf(case["hf_dir"])
        if case.get("ablate"):  # a feature removed from the spec: load the tensors it still has
            spec = dataclasses.replace(spec, **case["ablate"])
        t0 = time.perf_counter()
        if layout != (case["tp"], case["pp"], case["ep"]):
            layout = (case["tp"], case["pp"], case["ep"])
            groups = init_parallel(tp=case["tp"], pp=case["pp"], ep=case["ep"])
        opts = ModelBuildOptions(tp=case["tp"], pp=case["pp"], ep=case["ep"],
                                 sequence_parallel=spec.is_moe and case["tp"] > 1)  # as the trainer does
        chunks = build_model_chunks(spec, opts, pp_rank=groups.pp_rank)
        if case.get("load_ckpt"):
            load_model_checkpoint(chunks, case["load_ckpt"])
        else:
            src = case["hf_dir"]
            if case.get("ablate"):
                full = load_file(str(Path(src) / "model.safetensors"))
                src = {k: full[k] for k in hf_state_dict_keys(spec)}
            load_hf_weights(chunks, spec, groups, src)
        logits = megatron_logits(chunks, spec, groups, case["tokens"])
        err = max_relative_error(logits, case["ref_logits"]) if logits is not None else None
        exported = list(export_hf_weights(chunks, spec, groups))
        names, digest = _digest(exported)
        res = {"name": case["name"], "err": err, "digest": digest, "names": names}
        if rank == 0:
            res["tensors"] = dict(exported)
            if case.get("padded_rows_zero"):
                emb = chunks[0].embedding.word_embeddings.weight
                res["pad_zero"] = bool((emb[spec.vocab_size // groups.tp:] == 0).all()) if groups.tp == 1 \
                    else None
        if case.get("save_ckpt"):
            save_model_checkpoint(chunks, case["save_ckpt"], spec)
        res["seconds"] = time.perf_counter() - t0
        out.append(res)
    return out
