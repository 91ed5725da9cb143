"""Qwen3.5 / Qwen3.5-MoE conversion beyond the shared parity grid (``test_conversion_parity.py`` runs
both families at TP 1, TP 2 x PP 2 and EP 2 x PP {1, 2}): removing any one family feature from the
loaded Megatron model makes the logits comparison with transformers fail (TP 1, one rank), and under
``slow`` the ``maspo convert`` jobs (TP 2 / EP 2 import, PP 2 export, both ``--verify``) round-trip
bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
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


@pytest.mark.slow
def test_published_wrapper_through_megatron_and_back(tmp_path):
    """A tiny MoE checkpoint in the published layout (multimodal wrapper, fused experts, vision tower):
    text model out, into Megatron (EP 2, --verify), back to HF (PP 2, --verify), into the wrapper again:
    every tensor, vision included, bit for bit."""
    from megatron_maspo.conversion import jobs
    from megatron_maspo.conversion.qwen3_5_wrapper import join_wrapper, split_wrapper
    from tests.unit.conversion.test_qwen3_5_wrapper import _fuse_experts, _wrapper

    _, src = _wrapper(tmp_path, "qwen3_5_moe")
    src = _fuse_experts(src, tmp_path / "published")
    assert split_wrapper(src, tmp_path / "text")
    for res in (jobs.convert_hf_to_megatron(tmp_path / "text", tmp_path / "mc", ep=2, verify=True),
                jobs.convert_megatron_to_hf(tmp_path / "mc", tmp_path / "exported", pp=2, verify=True)):
        errs = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
        assert errs and max(errs) <= TOL, res
    join_wrapper(tmp_path / "exported", src, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
