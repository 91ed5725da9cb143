"""GLM-4.5 (``glm4_moe``) conversion against transformers' ``Glm4MoeForCausalLM``, every family feature on
(tiny model: a dense first layer, 8 experts in 4 groups with top-4 from 2 groups, routed scaling 2.5, a
shared expert, a random fp32 correction bias, QKV bias, q/k norm, rotary on half of each head).

* Ablations (one rank): removing any one feature from the spec (and loading the tensors the ablated
  spec still has) moves the logits far from transformers', so the parity figure sees each feature.
* ``maspo convert`` both ways (slow): in at TP 2 x EP 2, out at TP 2 x PP 2, both ``--verify`` figures
  within 1e-5, the export bitwise equal (an MTP layer ``model.layers.2.*`` passed through by name), its ``config.json`` reloading with the same effective fields,
  the exported folder giving the original logits, and a TP 1 reload of the Megatron checkpoint (the
  project's ``load_model_checkpoint``) matching transformers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from tests.distributed._conversion_workers import parity_cases
from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ABLATIONS = {
    "correction_bias": dict(moe_router_expert_bias=False),
    "shared_expert": dict(moe_shared_expert_intermediate_size=None),
    "group_limited_routing": dict(moe_router_num_groups=None, moe_router_group_topk=None),
    "routed_scaling_factor": dict(moe_router_topk_scaling_factor=None),
    "partial_rotary": dict(rotary_percent=1.0),
    "qk_norm": dict(qk_layernorm=False),
    "qkv_bias": dict(add_qkv_bias=False),
}


def _add_mtp_layer(hf_dir) -> None:
    """Append one MTP layer's tensors (bf16, as published GLM-4.5 checkpoints store ``model.layers.{L}.*``)."""
    from safetensors.torch import save_file

    sd = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128))):
        sd[f"model.layers.2.{name}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))


def _tiny(tmp_path, *, mtp: bool = False):
    hf_dir = tmp_path / "glm"
    model, _ = make_tiny_hf_model("glm4_moe", hf_dir, vocab_size=301, seed=5)
    if mtp:
        _add_mtp_layer(hf_dir)
    tokens = torch.randint(0, 301, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=tokens).logits.float()
    return model, hf_dir, tokens, ref


def test_each_family_feature_is_seen_by_the_parity_check(tmp_path):
    _, hf_dir, tokens, ref = _tiny(tmp_path)
    base = dict(hf_dir=str(hf_dir), tp=1, pp=1, ep=1, tokens=tokens, ref_logits=ref)
    cases = [dict(base, name="full")] + [dict(base, name=k, ablate=v) for k, v in ABLATIONS.items()]
    (res,) = run_workers(parity_cases, 1, cases, timeout_s=240)
    errs = {r["name"]: r["err"] for r in res}
    print({k: f"{v:.2e}" for k, v in errs.items()})
    assert errs.pop("full") <= 1e-5
    for name, err in errs.items():
        assert err > 1e-3, f"removing {name} left the logits within {err:.2e} of transformers"


def _cli(*args: str, capsys) -> float:
    from megatron_maspo.cli.main import main

    assert main(["convert", *args, "--verify"]) == 0
    out = capsys.readouterr().out
    return float(re.search(r"max relative logits error ([0-9.e+-]+)", out).group(1))


@pytest.mark.slow  # two 2-rank conversions and a 1-rank reload: ~60 s on 2 cores
def test_convert_tp2ep2_in_tp2pp2_out_is_exact(tmp_path, capsys):
    import transformers

    from megatron_maspo.model.hf_config import arch_spec_from_hf

    model, hf_dir, tokens, ref = _tiny(tmp_path, mtp=True)
    mc, back = tmp_path / "mcore", tmp_path / "back"
    assert _cli("hf-to-megatron", "--hf", str(hf_dir), "--out", str(mc), "--tp", "2", "--ep", "2", capsys=capsys) <= 1e-5
    assert _cli("megatron-to-hf", "--ckpt", str(mc), "--out", str(back), "--tp", "2", "--pp", "2",
                capsys=capsys) <= 1e-5
    src, got = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(src) == set(got)
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert got["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16  # the MTP layer, passed through
    # the exported config.json: the same effective fields in transformers, and the same spec
    a = transformers.AutoConfig.from_pretrained(hf_dir).to_dict()
    b = transformers.AutoConfig.from_pretrained(back).to_dict()
    skip = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "initializer_range"}
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
    assert arch_spec_from_hf(back) == arch_spec_from_hf(hf_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits.float(), ref)
    # TP 1 reload of the TP 2 x EP 2 checkpoint through load_model_checkpoint
    case = dict(name="tp1-reload", hf_dir=str(hf_dir), tp=1, pp=1, ep=1, tokens=tokens, ref_logits=ref,
                load_ckpt=str(mc))
    (res,) = run_workers(parity_cases, 1, [case], timeout_s=240)
    assert res[0]["err"] <= 1e-5
    assert json.loads((mc / "maspo_layer_spec.json").read_text())["layer_spec"] == "local"
