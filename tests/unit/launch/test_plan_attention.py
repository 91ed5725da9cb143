"""Planner: attention memory follows model.attention_backend (dense [S, S] tensors vs linear packed
paths, sequence parallelism on the TE path), and the dense path is refused at S = 16,384."""

from __future__ import annotations

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.launch.plan import GIB, arch_of, estimate, layout_of
from megatron_maspo.recipes.registry import load_recipe


def _plan(recipe: str, backend: str, **train):
    cfg = load_recipe(recipe)
    cfg.model.attention_backend = backend
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return estimate(cfg, arch_of(cfg), layout_of(cfg), nodes=4, gpus_per_node=8)


@pytest.mark.parametrize("recipe,heads,inflight", [("r1_distill_qwen_7b_maspo", 28 / 2, 1),
                                                   ("qwen3_30b_a3b_maspo", 32 / 1, 2)])
def test_dense_mask_counts_quadratic_attention_and_is_refused_at_16k(recipe, heads, inflight):
    packed, dense = _plan(recipe, "packed_sdpa"), _plan(recipe, "dense_mask")
    assert packed.fits and packed.memory.attention == 0.0
    s2 = 16384.0**2
    # both recipes: bf16, full recompute -> one layer's (4 + 2) n_t S^2 kept, running layer (2*2 + 4) n_t S^2
    want = inflight * s2 + 6 * heads * s2 + 8 * heads * s2
    assert dense.memory.attention == pytest.approx(want / GIB)
    assert dense.memory.activations == pytest.approx(packed.memory.activations)
    assert dense.memory.train_peak == pytest.approx(packed.memory.train_peak + want / GIB)
    assert not dense.fits
    assert any("attention_backend='dense_mask' holds" in r and "S=16384" in r for r in dense.reasons)


def test_dense_mask_fits_short_rows():
    """The dense path is not refused as such: at 4,096 tokens per row its [S, S] share is 1/16."""
    plan_cfg = load_recipe("r1_distill_qwen_7b_maspo")
    plan_cfg.model.attention_backend = "dense_mask"
    plan_cfg.rollout.max_new_tokens = 3072
    plan_cfg.train.max_tokens_per_micro_batch = 4096
    plan = estimate(plan_cfg, arch_of(plan_cfg), layout_of(plan_cfg), nodes=4, gpus_per_node=8)
    assert plan.fits, plan.reasons
    assert plan.memory.attention == pytest.approx(4096**2 * (1 + 6 * 14 + 8 * 14) / GIB)


def test_te_sequence_parallel_splits_the_hidden_sized_activations():
    te, packed = _plan("r1_distill_qwen_7b_maspo", "te"), _plan("r1_distill_qwen_7b_maspo", "packed_sdpa")
    h, n_tok, layers = 3584, 16384, 28
    # TP 2, bf16, full recompute: the e*h layer inputs, the e*4h of the recomputed layer and the final
    # hidden states are split over the 2 TP ranks under sequence parallelism
    saved = (layers * n_tok * 2 * h + n_tok * 2 * 4 * h + n_tok * h * 2) / 2
    assert te.memory.activations == pytest.approx(packed.memory.activations - saved / GIB)
    assert te.fits and te.memory.attention == 0.0


def test_cli_reports_the_selected_attention_path(capsys):
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4"]) == 0
    assert "attention (packed_sdpa): linear" in capsys.readouterr().out
    assert main(["plan", "r1_distill_qwen_7b_maspo", "--nodes", "4",
                 "--set", "model.attention_backend=dense_mask"]) == 1
    out = capsys.readouterr().out
    assert "attention (dense_mask): 49.2 GiB" in out and "REFUSED" in out
