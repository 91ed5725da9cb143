"""Megatron-Core on CPU: a tiny GPT (local spec, RMSNorm, SwiGLU, GQA, rotary) at TP=2 x PP=2 on 4 gloo
ranks through Megatron's pipeline schedule matches the TP=PP=1 loss and gradients; so does a 5-layer one
split unevenly over the pipeline (PP 2 as 3 + 2 layers, PP 3 as 1 + 2 + 2)."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.spec import ArchSpec
from tests.distributed._launch import run_workers

SPEC = ArchSpec(family="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=250,
                max_position_embeddings=64, add_qkv_bias=True, tie_word_embeddings=True)
SEQ, MICRO_B, N_MICRO = 16, 2, 4


def _worker(rank: int, world: int, tp: int, pp: int, spec: ArchSpec = SPEC,
            split: tuple[int | None, int | None] = (None, None)):
    from tests.distributed._actor_helpers import layer_ids
    from tests.distributed._gpt_helpers import build, full_named_grads, make_batches, run_schedule

    groups, chunks = build(spec, tp, pp, divisible_by=64, split=split)
    held = [layer_ids(c) for c in chunks]
    batches = make_batches(spec.vocab_size, N_MICRO, MICRO_B, SEQ)
    losses = run_schedule(chunks, batches, SEQ, MICRO_B)
    if groups.pp > 1:
        # Tied embedding grads live on the first and last stage; sum them as finalize_model_grads would.
        import torch.distributed as dist

        if groups.is_first_stage or groups.is_last_stage:
            w = chunks[0].shared_embedding_or_output_weight()
            dist.all_reduce(w.grad, group=groups.embd_group)
    grads = full_named_grads(chunks, groups, spec)
    obj = [losses]
    dist_losses = [None] * world
    import torch.distributed as dist

    dist.all_gather_object(dist_losses, obj[0])
    losses = max(dist_losses, key=len)  # only the last stage reports losses
    stages: list = [None] * world
    dist.all_gather_object(stages, (groups.pp_rank, held))
    return {"losses": losses, "grads": grads, "stages": dict(stages)} if rank == 0 else None


@pytest.mark.slow  # ~40-50 s on 2 cores; TP2 x PP2 of the real actor stays in the default run (tests/distributed/test_actor.py)
def test_tp2_pp2_matches_single_process():
    ref = run_workers(_worker, 1, 1, 1)[0]
    par = run_workers(_worker, 4, 2, 2)[0]
    _compare(ref, par)


SPEC5 = ArchSpec(family="qwen2", num_layers=5, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, kv_channels=16, vocab_size=250, max_position_embeddings=64,
                 add_qkv_bias=True, tie_word_embeddings=True)


@pytest.mark.parametrize("pp,split,held", [
    (2, (3, None), {0: [[0, 1, 2]], 1: [[3, 4]]}),
    (3, (1, None), {0: [[0]], 1: [[1, 2]], 2: [[3, 4]]}),
])
def test_uneven_pipeline_stages_match_single_process(pp, split, held):
    """Issue 56: 5 layers, which no pipeline of 2 or 3 even stages holds, split as Megatron's first-stage
    count says; each stage builds its layers (global ids), and loss and every gradient equal one rank's."""
    ref = run_workers(_worker, 1, 1, 1, SPEC5)[0]
    par = run_workers(_worker, pp, 1, pp, SPEC5, split)[0]
    assert par["stages"] == held
    _compare(ref, par)


def test_an_uneven_split_megatron_cannot_build_is_refused_before_any_rank_starts():
    from megatron_maspo.model.provider import ModelBuildOptions, build_transformer_config

    with pytest.raises(ValueError, match=r"5 is not divisible.*pp_first_layers"):
        build_transformer_config(SPEC5, ModelBuildOptions(pp=2))
    with pytest.raises(ValueError, match="do not split evenly over the 2 other stages"):
        build_transformer_config(SPEC5, ModelBuildOptions(pp=3, pp_first_layers=2))


def _compare(ref, par):
    assert len(ref["losses"]) == N_MICRO and len(par["losses"]) == N_MICRO
    torch.testing.assert_close(torch.tensor(par["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=1e-5)
    assert set(par["grads"]) == set(ref["grads"]), set(par["grads"]) ^ set(ref["grads"])
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, f"reference gradient of {name} is zero: the test would be vacuous"
        # Relative to the tensor's scale: fp32 sums in another order differ by ~1e-7 of the max.
        err = (par["grads"][name] - g).abs().max() / g.abs().max()
        assert err < 1e-5, f"{name}: max relative gradient error {err:.2e}"
