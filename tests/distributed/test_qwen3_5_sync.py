"""Weight sync of the hybrid Qwen3.5 models into the built-in engine (gloo, 2 ranks): the Megatron model
loaded from a tiny HF folder at TP 2 (dense) / EP 2 (MoE) is resharded into a randomly initialised
engine; every engine tensor then equals the HF export bitwise (no name missing or extra: GDN, gated
attention, shared expert and its gate included), and the engine's log-probs of its own greedy
generations (transformers' hybrid cache: recurrent state for linear layers, KV for full ones) equal the
Megatron model's within 2e-5."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from tests.distributed._launch import run_workers

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]
PROMPTS = [[5, 17, 33, 2, 9, 100], [250, 1, 42], [60, 61, 62, 63, 64, 65, 66, 67]]
MAX_TOKENS = 7


def _worker(rank: int, world: int, hf_dir: str, tp: int, ep: int) -> dict:
    import torch.distributed as dist

    from megatron_maspo.conversion.hf_to_megatron import load_hf_weights
    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.conversion.verify import megatron_logits
    from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.parallel.groups import init_parallel
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.rollout.weight_sync import sync_weights

    spec = arch_spec_from_hf(hf_dir)
    groups = init_parallel(tp=tp, ep=ep)
    chunks = build_model_chunks(spec, ModelBuildOptions(tp=tp, ep=ep), pp_rank=0)
    load_hf_weights(chunks, spec, groups, hf_dir)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(spec)) if rank == 0 else None
    stats = sync_weights(chunks, spec, groups, engine, bucket_bytes=50_000)
    exported = dict(export_hf_weights(chunks, spec, groups))
    res: dict = {}
    outs: list = [None]
    if rank == 0:
        from megatron_maspo.rollout.fused_experts import fused_slot

        params = dict(engine.model.named_parameters())
        # transformers keeps MoE experts fused in memory: a per-expert export name is a slice of one
        slots = {n: (n, ()) if n in params else fused_slot(n, params) for n in exported}
        res["names"] = sorted([n for n, s in slots.items() if s is None]
                              + list(set(params) - {s[0] for s in slots.values() if s}))
        res["bitwise"] = sorted(n for n, t in exported.items()
                                if slots[n] and not torch.equal(params[slots[n][0]][slots[n][1]], t))
        res["tensors"] = stats.num_tensors
        outs = [engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    dist.broadcast_object_list(outs, src=0)
    diffs = []
    for prompt, (comp,) in zip(PROMPTS, outs[0]):
        tokens = torch.tensor([prompt + comp.token_ids])
        logits = megatron_logits(chunks, spec, groups, tokens)
        lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
        ref = lp.gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        diffs.append(float((ref - torch.tensor(comp.logprobs)).abs().max()))
        assert comp.token_ids == lp.argmax(-1).tolist(), "engine greedy tokens differ from Megatron's argmax"
    res["lp_diff"] = max(diffs)
    return res


@pytest.mark.parametrize("family,tp,ep", [("qwen3_5", 2, 1), ("qwen3_5_moe", 1, 2)])
def test_sync_into_builtin_engine(tmp_path, family, tp, ep):
    make_tiny_hf_model(family, tmp_path, vocab_size=301, seed=4)
    r0 = run_workers(_worker, 2, str(tmp_path), tp, ep)[0]
    assert r0["names"] == [] and r0["bitwise"] == [], r0
    # HF tensors: embedding, final norm, head; 3 GDN layers (2 norms + 9 mixer tensors) and 1 full layer
    # (2 norms + q, k, v, q/k norm, o); per layer an MLP of 3, or 4 experts x 3 + router + shared (3) + gate
    mlp = 4 * 3 + 1 + 3 + 1 if family == "qwen3_5_moe" else 3
    assert r0["tensors"] == 3 + 3 * 11 + 8 + 4 * mlp, r0
    assert r0["lp_diff"] < 2e-5, r0
