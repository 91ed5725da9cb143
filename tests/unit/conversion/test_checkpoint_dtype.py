"""Conversion builds the model in the checkpoint's dtype (not fp32), and round-trips bf16 bit-exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_maspo.conversion.jobs import (
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    hf_checkpoint_dtype,
    megatron_checkpoint_dtype,
)
from megatron_maspo.model.tiny_hf import make_tiny_hf_model


def test_hf_dtype_is_read_from_config(tmp_path):
    for key, value, want in (("torch_dtype", "bfloat16", torch.bfloat16), ("dtype", "float16", torch.float16),
                             (None, None, torch.float32)):
        d = tmp_path / str(key)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({key: value} if key else {}))
        assert hf_checkpoint_dtype(d) == want
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        hf_checkpoint_dtype(tmp_path / "bad")


@pytest.mark.slow  # two spawned conversions: ~60 s on 2 shared cores
def test_bf16_checkpoint_converts_in_bf16_and_back_bit_exact(tmp_path):
    model, _ = make_tiny_hf_model("llama", vocab_size=301)
    hf = tmp_path / "hf"
    model.to(torch.bfloat16).save_pretrained(hf)
    assert hf_checkpoint_dtype(hf) == torch.bfloat16
    res = convert_hf_to_megatron(hf, tmp_path / "mcore", verify=True)
    # Megatron and the HF reference both run in bf16: a mapping error would give O(1)
    assert res[0]["max_rel_error"] < 3e-2, res
    assert megatron_checkpoint_dtype(tmp_path / "mcore") == torch.bfloat16
    # the spec that built it travels with it (and is what megatron-to-hf rebuilds)
    rec = json.loads((tmp_path / "mcore" / "maspo_layer_spec.json").read_text())
    assert rec["layer_spec"] == "local" and rec["moe_grouped_gemm"] is False
    convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    src, back = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) <= set(src)
    for k, t in back.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, src[k]), k
