"""``maspo convert`` for DeepSeek-V3 end to end: HF -> Megatron at one layout with ``--verify``, back to HF at
another with ``--verify``; the export is bit for bit the source, MTP layers included (passed through by
name, conversion/passthrough.py), and the exported ``config.json`` has the source's effective fields."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_maspo.conversion.jobs import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_maspo.model.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _with_mtp_layer(hf_dir) -> dict[str, torch.Tensor]:
    """Add the tensors of one MTP layer (``model.layers.{L}``, DeepSeek-V3's names) to the saved model."""
    sd = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    mtp = {f"model.layers.2.{k}": torch.randn(shape, generator=g) for k, shape in
           {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128),
            "shared_head.norm.weight": (64,), "self_attn.kv_b_proj.weight": (128, 32),
            "mlp.down_proj.weight": (64, 128)}.items()}
    sd.update(mtp)
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return sd


@pytest.mark.parametrize("layout_in,layout_out", [
    pytest.param((1, 1), (1, 1), id="tp1-tp1", marks=pytest.mark.slow),  # two spawned jobs: ~50 s
    pytest.param((2, 1), (1, 2), id="tp2-pp2", marks=pytest.mark.slow),
])
def test_convert_round_trip_with_verify_and_mtp_passthrough(tmp_path, layout_in, layout_out):
    hf = tmp_path / "hf"
    make_tiny_hf_model("deepseek_v3", hf, vocab_size=301, seed=3)
    src = _with_mtp_layer(hf)
    res = convert_hf_to_megatron(hf, tmp_path / "mc", tp=layout_in[0], pp=layout_in[1], verify=True)
    errs = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
    assert errs and max(errs) <= 1e-5
    res = convert_megatron_to_hf(tmp_path / "mc", tmp_path / "out", tp=layout_out[0], pp=layout_out[1], verify=True)
    errs = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
    assert errs and max(errs) <= 1e-5
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(src)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in src.items())
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf, tmp_path / "out"))
    derived = {"transformers_version", "dtype", "torch_dtype", "qk_head_dim", "head_dim"}  # recomputed on load
    same_when_set = {k for k in a if k not in derived and k in b}
    assert all(a[k] == b[k] for k in same_when_set if k != "rope_parameters"), \
        {k: (a[k], b[k]) for k in same_when_set if a[k] != b[k]}
    assert {k: v for k, v in b["rope_parameters"].items()} == a["rope_parameters"]
    assert b["num_nextn_predict_layers"] == 1 and b["first_k_dense_replace"] == 1
