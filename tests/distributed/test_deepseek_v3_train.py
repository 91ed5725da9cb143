"""DeepSeek-V3 in the trainer: the packed training forward and its gradients against transformers at TP 1,
and the actor's loss, gradients and step at EP2 / PP2 / TP2 x EP2 (MoE) and TP2 (all-dense) against one rank."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_maspo.model.hf_config import arch_spec_from_hf
from megatron_maspo.model.tiny_hf import TINY_DEFAULTS, make_tiny_hf_model
from tests.distributed import _actor_helpers as H
from tests.distributed._launch import run_workers
from tests.distributed._mla_workers import packed_logprob_grads
from tests.distributed.test_actor import _close, _close_after_adam, _moe_procedure

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _hf_grads(model) -> dict[str, torch.Tensor]:
    """transformers' gradients under checkpoint names (its fused experts split per expert, gate rows first)."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = p.grad[e].split(inter)
        elif name.endswith("mlp.experts.down_proj"):
            out.update((f"{name.removesuffix('down_proj')}{e}.down_proj.weight", p.grad[e]) for e in range(p.shape[0]))
        else:
            out[name] = p.grad
    return out


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_packed_training_forward_and_grads_match_transformers(tmp_path, tp):
    """TP 1 on the MoE tiny model; TP 2 (all-dense: MoE needs TP 1 on the local spec) checks the rotary key's
    gradient across TP ranks (model/mla.py, ``MLASelfAttentionTP``)."""
    model, _ = make_tiny_hf_model("deepseek_v3", tmp_path, vocab_size=301, seed=21,
                                  **({"first_k_dense_replace": 2} if tp > 1 else {}))
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, 301, (n,), generator=g).tolist() for n in (7, 13, 5)]
    got = run_workers(packed_logprob_grads, tp, str(tmp_path), seqs, tp)[0]
    model.zero_grad()
    ref_lp, loss = [], 0.0
    for s in seqs:  # one sequence at a time: what the packed row must reproduce
        ids = torch.tensor([s])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        (-lp.sum()).backward()
        ref_lp.append(lp.detach())
        loss += -float(lp.sum())
    assert math.isclose(got["loss"], loss, rel_tol=1e-6)
    for a, b in zip(got["logprobs"], ref_lp):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    ref = _hf_grads(model)
    assert set(got["grads"]) == set(ref)
    for k, v in ref.items():
        scale = float(v.abs().max()) or 1.0
        assert float((got["grads"][k] - v).abs().max()) <= 1e-5 * max(scale, 1.0), k
    assert tp > 1 or any(float(v.abs().max()) > 0 for k, v in got["grads"].items() if ".experts." in k)


def _spec(**patch):
    d = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": H.VOCAB,
         **TINY_DEFAULTS["deepseek_v3"], **patch}
    return arch_spec_from_hf(d)


def _reference(rank: int, world: int) -> dict:
    return {"moe": _moe_procedure(H.build_actor(world, spec=_spec())),
            "dense": _moe_procedure(H.build_actor(world, spec=_spec(first_k_dense_replace=2)))}


def _layouts(rank: int, world: int) -> dict:
    res = {"ep2": _moe_procedure(H.build_actor(world, ep=2, spec=_spec())),
           "pp2": _moe_procedure(H.build_actor(world, pp=2, spec=_spec())),
           "tp2": _moe_procedure(H.build_actor(world, tp=2, spec=_spec(first_k_dense_replace=2))),
           # TP 2 x EP 2 on the same two ranks: sequence parallelism on (MoE at TP > 1), MLA's latent norms too
           "tp2ep2": _moe_procedure(H.build_actor(world, tp=2, ep=2, spec=_spec()))}
    return res if rank == 0 else {}


@pytest.mark.slow
def test_actor_layouts_match_one_rank():
    ref = run_workers(_reference, 1)[0]
    res = run_workers(_layouts, 2)[0]
    for name, base in (("ep2", "moe"), ("pp2", "moe"), ("tp2", "dense"), ("tp2ep2", "moe")):
        r, r1 = res[name], ref[base]
        assert r["first_dev"] == 0.0 and r1["first_dev"] == 0.0, name
        for x, y in zip(r["lp"], r1["lp"]):
            assert torch.allclose(x, y, atol=2e-6), name
        assert math.isclose(r["loss"], r1["loss"], rel_tol=1e-5, abs_tol=1e-6), name
        # untied head: its padded rows (128 * tp) differ in number, the vocabulary's do not
        for d in (r["grads"], r1["grads"], r["params"], r1["params"]):
            d["output_layer.weight"] = d["output_layer.weight"][:H.VOCAB]
        _close(r["grads"], r1["grads"], atol=1e-6)
        assert math.isclose(r["step"]["actor/grad_norm"], r1["step"]["actor/grad_norm"], rel_tol=1e-5), name
        _close_after_adam(r["params"], r1["params"], r1["grads"])
    assert ref["moe"]["step"]["actor/grad_norm"] > 0
