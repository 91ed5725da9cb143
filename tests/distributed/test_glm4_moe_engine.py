"""GLM-4.5 weight sync into the built-in engine at TP 2 x EP 2 (2 ranks: experts over the TP ranks): after
every Megatron tensor is changed (correction bias included), the engine's parameters and persistent
buffers equal the HF export bitwise (per-expert tensors in transformers' fused expert slots)."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _worker(rank: int, world: int, hf_dir: str) -> dict:
    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.conversion.plan import chunk_tensors
    from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine, synced_tensors
    from megatron_maspo.rollout.fused_experts import fused_slot
    from megatron_maspo.rollout.weight_sync import sync_weights

    spec = arch_spec_from_hf(hf_dir)
    groups = init_parallel(tp=2, ep=2)
    chunks = build_model_chunks(spec, ModelBuildOptions(tp=2, ep=2, sequence_parallel=True), pp_rank=0)
    load_hf_weights(chunks, spec, groups, hf_dir)
    with torch.no_grad():  # a trained policy: every tensor moved (same change on every rank of a shard)
        for name, t in chunk_tensors(chunks[0]).items():
            t.add_(0.01 * torch.sin(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + len(name)))
    engine = BuiltinEngine.from_hf_config(hf_config_dict(spec)) if rank == 0 else None
    sync_weights(chunks, spec, groups, engine, bucket_bytes=50_000)
    exported = dict(export_hf_weights(chunks, spec, groups))
    if rank != 0:
        return {}
    got = synced_tensors(engine.model)

    def engine_tensor(name: str) -> torch.Tensor:  # per-expert names live in transformers' fused experts
        if name in got:
            return got[name]
        fused, idx = fused_slot(name, got)
        return got[fused][idx]

    return {"unknown": sorted(set(got) - set(exported) - {fused_slot(n, got)[0] for n in exported if n not in got}),
            "differ": sorted(n for n, t in exported.items() if not torch.equal(engine_tensor(n), t)),
            "bias": "model.layers.1.mlp.gate.e_score_correction_bias" in got}


def test_engine_weights_equal_the_export_tp2_ep2(tmp_path):
    make_tiny_hf_model("glm4_moe", tmp_path, vocab_size=301, seed=1)
    res = run_workers(_worker, 2, str(tmp_path), timeout_s=240)[0]
    assert res["bias"] and res["unknown"] == [] and res["differ"] == []
