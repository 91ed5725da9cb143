"""Qwen3.5 / Qwen3.5-MoE conversion against transformers: tiny seeded fp32 text models saved by
``save_pretrained`` load into the hybrid Megatron model (logits within 1e-5 relative), export back bit
for bit, and removing any one family feature makes the logits comparison fail.

Default run: TP 1 (one rank). ``slow``: dense TP 2 and PP 2, MoE EP 2 and PP 2 (two gloo ranks), and
the ``maspo convert`` jobs (TP 2 / EP 2 import, PP 2 export, both ``--verify``).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from tests.distributed._conversion_workers import parity_cases
from tests.distributed._launch import run_workers
from tests.distributed._qwen3_5_workers import ABLATIONS, ablation_errors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FAMILIES = ("qwen3_5", "qwen3_5_moe")
TOL = 1e-5


def _tokens() -> torch.Tensor:
    return torch.randint(0, 301, (2, 19), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (hf_dir, reference logits, safetensors tensors)."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        d = tmp_path_factory.mktemp(fam)
        model, _ = make_tiny_hf_model(fam, d, vocab_size=301, seed=i)
        with torch.no_grad():
            ref = model(input_ids=_tokens()).logits.float()
        out[fam] = (str(d), ref, load_file(str(d / "model.safetensors")))
    return out


def _run(tiny, world, layouts):
    cases = [dict(name=f"{fam}-tp{tp}pp{pp}ep{ep}", hf_dir=tiny[fam][0], tp=tp, pp=pp, ep=ep, tokens=_tokens(),
                  ref_logits=tiny[fam][1], family=fam) for fam, (tp, pp, ep) in layouts]
    results = run_workers(parity_cases, world, cases)
    for case, per_rank in zip(cases, zip(*results, strict=True), strict=True):
        errs = [r["err"] for r in per_rank if r["err"] is not None]
        assert errs and max(errs) <= TOL, f"{case['name']}: logits relative error {max(errs):.3e}"
        assert len({r["digest"] for r in per_rank}) == 1, case["name"]
        ref, got = tiny[case["family"]][2], per_rank[0]["tensors"]
        assert set(got) == set(ref), case["name"]
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{case['name']}: {k} not bit-exact"


def test_tp1_logits_and_bitwise_export(tiny):
    _run(tiny, 1, [("qwen3_5", (1, 1, 1)), ("qwen3_5_moe", (1, 1, 1))])


@pytest.mark.slow
def test_tp2_pp2_ep2(tiny):
    _run(tiny, 2, [("qwen3_5", (2, 1, 1)), ("qwen3_5", (1, 2, 1)), ("qwen3_5_moe", (1, 1, 2)),
                   ("qwen3_5_moe", (1, 2, 1))])


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_a_feature_breaks_parity(tiny, family):
    names = [n for n in ABLATIONS if family == "qwen3_5_moe" or n != "shared_expert_gate"]
    hf_dir, ref, _ = tiny[family]
    errs = run_workers(ablation_errors, 1, hf_dir, _tokens(), ref, names)[0]
    assert errs["none"] <= TOL, errs
    failing = {n: e for n, e in errs.items() if n != "none" and not e > 1e-3}
    assert not failing, f"{family}: removing these features did not change the logits: {failing}"


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [("qwen3_5", dict(tp=2)), ("qwen3_5_moe", dict(ep=2))])
def test_cli_jobs_round_trip(tiny, tmp_path, family, layout):
    from megatron_maspo.conversion import jobs

    hf_dir, _, ref = tiny[family]
    for res in (jobs.convert_hf_to_megatron(hf_dir, tmp_path / "mc", verify=True, **layout),
                jobs.convert_megatron_to_hf(tmp_path / "mc", tmp_path / "hf", pp=2, verify=True)):
        errs = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
        assert errs and max(errs) <= TOL, res
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items())
