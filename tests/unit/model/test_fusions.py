"""Fusion flags: on with CUDA (and the kernel each needs), off on CPU; accepted by Megatron's config."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.provider import (
    ModelBuildOptions,
    build_transformer_config,
    detected_fusion_options,
    fusion_options,
)
from megatron_maspo.model.spec import tiny_qwen2_spec

FLAGS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
         "gradient_accumulation_fusion", "persist_layer_norm")


def test_all_fusions_off_on_cpu_whatever_is_installed():
    opts = fusion_options(False, has_te=True, has_softmax_kernel=True, has_grad_accum_kernel=True)
    assert set(opts) == set(FLAGS)
    assert not any(opts.values())


def test_cuda_turns_on_the_fusions_megatron_runs_without_te_or_apex():
    opts = fusion_options(True)
    assert opts["bias_activation_fusion"] and opts["bias_dropout_fusion"]
    # each of these needs a kernel Megatron does not ship: off until it is importable
    assert not opts["masked_softmax_fusion"] and not opts["apply_rope_fusion"]
    assert not opts["gradient_accumulation_fusion"] and not opts["persist_layer_norm"]


@pytest.mark.parametrize("kw, flag", [({"has_te": True}, "apply_rope_fusion"),
                                      ({"has_softmax_kernel": True}, "masked_softmax_fusion"),
                                      ({"has_grad_accum_kernel": True}, "gradient_accumulation_fusion")])
def test_kernel_dependent_fusion_follows_its_kernel(kw, flag):
    assert fusion_options(True, **kw)[flag]
    assert not fusion_options(False, **kw)[flag]
    others = {k: v for k, v in fusion_options(True, **kw).items() if k != flag}
    assert others == {k: v for k, v in fusion_options(True).items() if k != flag}


def test_transformer_config_carries_the_detected_flags():
    cfg = build_transformer_config(tiny_qwen2_spec(vocab_size=64), ModelBuildOptions())
    detected = detected_fusion_options()
    assert {k: getattr(cfg, k) for k in FLAGS} == detected
    if not torch.cuda.is_available():
        assert not any(detected.values())


def test_megatron_accepts_the_cuda_flags_for_our_architecture():
    """TransformerConfig validates bias_activation_fusion against the activation (SwiGLU, no bias)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, activation_func=F.silu,
                      gated_linear_unit=True, add_bias_linear=False, **fusion_options(True))


def test_jit_fusions_off_leaves_every_fusion_off_even_on_cuda(monkeypatch):
    """The converter's build (``jit_fusions=False``): no compiled kernel, whatever the machine has."""
    from megatron_maspo.model import provider

    monkeypatch.setattr(provider, "detected_fusion_options", lambda: fusion_options(True))
    spec = tiny_qwen2_spec(vocab_size=64)
    on = build_transformer_config(spec, ModelBuildOptions())
    off = build_transformer_config(spec, ModelBuildOptions(jit_fusions=False))
    assert on.bias_activation_fusion and on.bias_dropout_fusion
    assert not any(getattr(off, k) for k in FLAGS)

