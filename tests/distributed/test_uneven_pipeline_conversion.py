"""Issue 56: conversion and the distributed checkpoint with uneven pipeline stages, through the product's
conversion jobs (spawned gloo ranks). A 5-layer Qwen2 goes HF -> Megatron at PP 3 as 1 + 2 + 2 layers
(``--verify``: logits against transformers), back to HF at PP 1 (the checkpoint written unevenly, read by
one rank) and at PP 2 as 3 + 2; every exported tensor equals the original file bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_maspo.conversion.jobs import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_maspo.errors import ConfigError
from megatron_maspo.model.tiny_hf import make_tiny_hf_model


def _same_tensors(a, b):
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(ta) == set(tb)
    for k, v in ta.items():
        assert tb[k].dtype == v.dtype and torch.equal(tb[k], v), k


def test_uneven_stages_convert_both_ways_and_reshard_to_even(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_hf_model("qwen2", hf, num_hidden_layers=5, seed=4)
    ckpt = tmp_path / "pp3"
    res = convert_hf_to_megatron(hf, ckpt, pp=3, pp_first_layers=1, verify=True)
    errs = [r["max_rel_error"] for r in res if r.get("max_rel_error") is not None]
    assert len(res) == 3 and errs and max(errs) <= 1e-5, errs
    back = convert_megatron_to_hf(ckpt, tmp_path / "back_pp1", pp=1, verify=True)
    assert max(r["max_rel_error"] for r in back if r.get("max_rel_error") is not None) <= 1e-5
    _same_tensors(hf, tmp_path / "back_pp1")
    convert_megatron_to_hf(ckpt, tmp_path / "back_pp2", pp=2, pp_first_layers=3)
    _same_tensors(hf, tmp_path / "back_pp2")


def test_a_split_that_does_not_cover_the_layers_is_refused_with_the_flag_to_use(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_hf_model("qwen2", hf, num_hidden_layers=5, seed=4)
    with pytest.raises(ConfigError, match=r"--pp 2.*not divisible.*--pp-first-layers"):
        convert_hf_to_megatron(hf, tmp_path / "out", pp=2)
    with pytest.raises(ConfigError, match="do not split evenly"):
        convert_hf_to_megatron(hf, tmp_path / "out", pp=3, pp_first_layers=2)
    assert not (tmp_path / "out").exists()
