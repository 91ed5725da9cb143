"""Weights verified where they land (built-in engine): the digests the sender packs with each sync match
what a real engine holds after loading, dense and MoE (fused experts), full and sampled; one flipped bit
inside the engine after loading, or one parameter left at its previous version, stops the sync with one
line naming the tensor and the engine; a sync without digests is not verified."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout import digest
from megatron_maspo.rollout.buckets import pack_buckets
from megatron_maspo.rollout.builtin_engine import BuiltinEngine


def _export(family: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under checkpoint names, as a sync delivers them (per-expert for MoE)."""
    model, _ = make_tiny_hf_model(family, vocab_size=301, seed=seed)
    out = []
    for n, p in model.named_parameters():
        p = p.detach().clone()
        if n.endswith("experts.gate_up_proj"):  # transformers 5 fuses experts in memory: [E, 2I, H]
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out += [(n.replace("gate_up_proj", f"{e}.gate_proj.weight"), p[e, :half].clone()),
                        (n.replace("gate_up_proj", f"{e}.up_proj.weight"), p[e, half:].clone())]
        elif n.endswith("experts.down_proj"):
            out += [(n.replace("down_proj", f"{e}.down_proj.weight"), p[e].clone()) for e in range(p.shape[0])]
        else:
            out.append((n, p))
    saved = model.state_dict().keys()  # persistent float buffers: the routers' correction bias (GLM, DeepSeek)
    out += [(n, b.detach().clone()) for n, b in model.named_buffers() if n in saved and b.is_floating_point()]
    return out


def _engine(family: str) -> BuiltinEngine:
    engine = BuiltinEngine(make_tiny_hf_model(family, vocab_size=301, seed=0)[0])
    engine.label = "builtin engine 3"
    return engine


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("sync_index,every", [(0, 1), (0, 4), (1, 4), (3, 4)])
def test_synced_weights_pass_verification(family, sync_index, every):
    engine = _engine(family)
    weights = _export(family, seed=1)
    buckets = list(pack_buckets(weights, 4096, digests=digest.plan(sync_index, every)))
    assert sum(len(b.digests) for b in buckets) == len(weights)  # one digest per exported tensor
    assert family not in ("qwen3_moe", "glm4_moe") or any(".experts.1.up_proj." in n for n, _ in weights)
    assert family not in ("glm4_moe", "deepseek_v3") or any("e_score_correction_bias" in n for n, _ in weights)
    engine.load_buckets(buckets)
    assert engine.policy_version == 1 and engine.verify_s > 0
    assert (engine.verify_full_s is not None) == (sync_index % every == 0)


@pytest.mark.parametrize("kind", ["flip", "stale"])
def test_a_corrupt_or_stale_parameter_stops_the_sync_naming_it(kind):
    engine = _engine("qwen2")
    engine.load_buckets(pack_buckets(_export("qwen2", seed=1), 4096, digests=digest.plan(0, 1)))
    name = "model.layers.1.mlp.down_proj.weight"
    engine.inject_fault(kind, name)
    with pytest.raises(digest.WeightVerifyError) as err:
        engine.load_buckets(pack_buckets(_export("qwen2", seed=2), 4096, digests=digest.plan(1, 1)))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"weight verification failed on builtin engine 3: tensor '{name}' after weight "
                          "version 2: digest ")


def test_a_stale_expert_slot_of_a_fused_moe_parameter_is_named():
    engine = _engine("qwen3_moe")
    engine.load_buckets(pack_buckets(_export("qwen3_moe", seed=1), 4096, digests=digest.plan(0, 1)))
    name = "model.layers.0.mlp.experts.2.up_proj.weight"  # a slot of the fused gate_up_proj
    engine.inject_fault("stale", name)
    with pytest.raises(digest.WeightVerifyError, match=f"tensor '{name}'"):
        engine.load_buckets(pack_buckets(_export("qwen3_moe", seed=2), 4096, digests=digest.plan(1, 1)))


def test_without_digests_nothing_is_verified():
    engine = _engine("qwen2")
    engine.inject_fault("flip")
    engine.load_buckets(pack_buckets(_export("qwen2", seed=1), 4096))  # digests=None: rollout.verify_every=0
    assert engine.verify_s == 0.0 and engine.policy_version == 1
