"""Multi-latent attention (DeepSeek-V3) against transformers on gloo: variants, long positions, ablations.

The family's default conversion cases (TP1 and TP2xPP2, export bit for bit) run in
test_conversion_parity.py. Here, on the tiny DeepSeek-V3 (YaRN, q_lora, interleaved rotary rows,
all layers dense): the HF variants without q_lora, with rotate-half rotary rows and without YaRN at
TP2, positions past YaRN's original context, the ``dense_mask`` reference core attention, a TP2xPP2
dist checkpoint reloaded at TP1 through ``load_model_checkpoint``; then each DeepSeek-V3 feature is
removed from the Megatron side (the spec the model is built and converted with) and the comparison must
fail: it would not, were the feature not reproduced.
"""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from tests.distributed._conversion_workers import parity_cases
from tests.distributed._launch import run_workers
from tests.distributed._mla_workers import ablation_errors
from tests.distributed.test_conversion_parity import _check

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VARIANTS = {"base": {}, "no_q_lora": {"q_lora_rank": None}, "rotate_half": {"rope_interleave": False},
            "no_yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for i, (name, patch) in enumerate(VARIANTS.items()):
        d = tmp_path_factory.mktemp(name)
        model, _ = make_tiny_hf_model("deepseek_v3", d, vocab_size=301, seed=10 + i, **patch)
        out[name] = (d, model)
    return out


def _ref(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def test_variants_long_positions_and_tp1_reload(models, tmp_path):
    from safetensors.torch import load_file

    short = torch.randint(0, 301, (2, 20), generator=torch.Generator().manual_seed(4))
    long = torch.randint(0, 301, (1, 160), generator=torch.Generator().manual_seed(5))  # > 128: YaRN's original
    cases, refs = [], {}
    for name, (d, model) in models.items():
        refs[name] = load_file(str(d / "model.safetensors"))
        cases.append(dict(name=f"{name}-tp2", hf_dir=str(d), tp=2, pp=1, ep=1, tokens=short,
                          ref_logits=_ref(model, short), family=name))
    d, model = models["base"]
    ckpt = str(tmp_path / "dsv3_tp2pp2")
    cases += [dict(name="base-long-tp1", hf_dir=str(d), tp=1, pp=1, ep=1, tokens=long,
                   ref_logits=_ref(model, long), family="base"),
              dict(name="base-tp2pp2-save", hf_dir=str(d), tp=2, pp=2, ep=1, tokens=short,
                   ref_logits=_ref(model, short), family="base", save_ckpt=ckpt)]
    cases.append(dict(cases[-1], name="base-ckpt-tp1", tp=1, pp=1, save_ckpt=None, load_ckpt=ckpt))
    # by layout (one group creation each), the reload after the save
    cases.sort(key=lambda c: (c.get("load_ckpt") is not None, c["tp"], c["pp"], c["ep"]))
    results = run_workers(parity_cases, 4, cases, timeout_s=300)
    _check(results, cases, refs)


def test_each_deepseek_feature_is_seen(models):
    """Removing a feature on the Megatron side must break the match (relative error > 1e-3) or the load."""
    tokens = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(6))
    ablations = {
        "base": {"exact": {}, "interleaved rotary": {"mla_rope_interleave": False},
                 "yarn": {"rope_scaling": None, "rope_scaling_factor": 1.0},
                 "yarn softmax mscale": {"yarn_mscale_all_dim": 0.0},
                 "yarn cos/sin concentration": {"yarn_mscale": 0.5},
                 "q_lora": {"q_lora_rank": None}},
        "rotate_half": {"exact": {}, "rotary de-interleave": {"mla_rope_interleave": True}},
        "no_q_lora": {"exact": {}},
    }
    cases = [dict(name=f"{m}/{what}", hf_dir=str(models[m][0]), ablate=ablate, backend="packed_sdpa",
                  tokens=tokens, ref_logits=_ref(models[m][1], tokens))
             for m, table in ablations.items() for what, ablate in table.items()]
    cases.append(dict(cases[0], name="base/exact dense_mask", backend="dense_mask"))
    results = {r["name"]: r for r in run_workers(ablation_errors, 1, cases, timeout_s=300)[0]}
    for name, r in results.items():
        print(f"{name}: {r['err'] if r['refused'] is None else 'refused: ' + r['refused'][:80]}")
        if name.endswith("exact") or name.endswith("dense_mask"):
            assert r["err"] is not None and r["err"] <= 1e-5, name
        elif r["refused"] is None:
            assert r["err"] > 1e-3, f"{name}: ablation not seen (error {r['err']:.2e})"
    assert results["base/q_lora"]["refused"] and "q_a_proj" in results["base/q_lora"]["refused"]
