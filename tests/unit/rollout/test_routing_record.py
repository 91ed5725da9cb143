"""The built-in engine's routed experts equal the gates' choices of one teacher-forced forward."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout.builtin_engine import BuiltinEngine
from megatron_maspo.rollout.routing import RoutingRecorder, moe_gates
from megatron_maspo.rollout.types import SamplingParams


def _teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), L, k]`` experts of one full forward over ``ids``."""
    with RoutingRecorder(model) as rec, torch.no_grad():
        rec.begin_call(1, len(ids))
        model(input_ids=torch.tensor([ids]))
        rec.end_call()
    return torch.stack(rec.steps[0], dim=2)[0]


def test_routed_experts_match_a_full_forward():
    model, _ = make_tiny_hf_model("qwen3_moe", seed=3)
    engine = BuiltinEngine(model, device="cpu")
    prompts = [[5, 9, 2, 7, 11], [4, 8]]  # different lengths: left padding in the prefill
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1, stop_token_ids=[3])
    plain = engine.generate(prompts, params)
    assert all(c.routed_experts is None for g in plain for c in g)
    engine.record_routing = True
    out = engine.generate(prompts, params)
    k, layers = model.config.num_experts_per_tok, model.config.num_hidden_layers
    assert len(moe_gates(model)) == layers
    for p, group, group_plain in zip(prompts, out, plain):
        for c, c0 in zip(group, group_plain):
            assert c.token_ids == c0.token_ids  # recording changes nothing in the sampling
            r = c.routed_experts
            assert r.dtype == torch.int16 and r.shape == (len(p) + len(c.token_ids) - 1, layers, k)
            ref = _teacher_forced(model, p + c.token_ids[:-1])
            # top-k *sets* per token and layer (KV-cached decode and one full forward agree in fp32)
            assert torch.equal(r.long().sort(-1).values, ref.long().sort(-1).values)
    engine.record_routing = False
    assert all(c.routed_experts is None for g in engine.generate(prompts, params) for c in g)


def test_per_expert_checkpoint_names_load_into_fused_experts(tmp_path):
    """Weight sync speaks checkpoint names (one tensor per expert); transformers 5 fuses experts."""
    from safetensors.torch import load_file

    model, config = make_tiny_hf_model("qwen3_moe", tmp_path, seed=5)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in tensors)  # per-expert on disk
    engine = BuiltinEngine.from_hf_config(config, device="cpu")
    engine.load_weights(tensors.items())
    ids = torch.tensor([[5, 9, 2, 7, 11, 4]])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, model(input_ids=ids).logits)
    partial_ = {k: v for k, v in tensors.items() if ".experts.1.up_proj" not in k}
    with pytest.raises(ValueError, match="parameters not delivered"):
        BuiltinEngine.from_hf_config(config, device="cpu").load_weights(partial_.items())
