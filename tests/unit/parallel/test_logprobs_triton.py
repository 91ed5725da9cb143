"""The Triton log-prob + entropy kernels (``parallel/logprobs_triton.py``) under Triton's CPU interpreter,
against the torch chunk loop and a float64 reference: values and both gradients, vocabularies that are
not a multiple of the tile, padded rows, temperature, masked labels, bf16 inputs, and TP 2 on gloo.

Triton reads ``TRITON_INTERPRET`` when it is first imported, which in a test session has long happened
(megatron-core imports it), so the cases (``_triton_cases.py``) run in one process of their own started
with it set; each test checks its case's figures. Small shapes: the interpreter runs programs in numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cases() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.unit.parallel._triton_cases"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _case(cases: dict, name: str) -> dict:
    got = cases[name]
    assert "error" not in got, got.get("error")
    return got


@pytest.mark.parametrize("name", ["fp32_t1", "fp32_t07"])
def test_fp32_matches_the_torch_path_and_float64_within_1e_5(cases, name):
    got = _case(cases, name)  # log-prob, entropy, d_hidden, d_weight
    assert max(got["vs_float64"]) < 1e-5 and max(got["vs_torch"]) < 1e-5, got
    assert got["padded_grad_max"] == 0.0  # padded rows: no gradient
    assert got["masked_logprob"] == [0.0, 0.0] and got["entropy_min"] > 0  # masked: lp 0, entropy valid


def test_bf16_inputs_accumulate_in_fp32(cases):
    # the interpreter computes bf16 tl.dot wrong without an error: the kernels cast their loads to fp32 there
    got = _case(cases, "bf16")
    lp, ent, dh, dw = got["vs_float64"]
    assert lp < 2e-3 and ent < 2e-3, got  # fp32 logits: closer than the torch path's bf16 tile
    assert lp < got["torch_vs_float64"][0] and ent < got["torch_vs_float64"][1], got
    # gradients come back in bf16 (and dz is a bf16 tile, as on the torch path): a few ulps of their scale
    assert dh < 1e-2 * got["grad_scale"][0] and dw < 1e-2 * got["grad_scale"][1], got


def test_splits_merge_to_the_statistics_of_one_sweep(cases):
    got = _case(cases, "splits")
    assert max(got["1"]) < 1e-5 and max(got["4"]) < 1e-5, got


def test_auto_keeps_the_torch_path_off_cuda_and_unknown_kernels_are_refused(cases):
    got = _case(cases, "choice")
    assert (got["auto"], got["torch"], got["triton"]) == (False, False, True)  # triton: the interpreter here
    assert got["unknown"] == "logprob kernel 'cuda'; accepted: auto, torch, triton"
    assert "accumulates in fp32" in got["fp64"]


def test_tp2_on_gloo_equals_one_rank(cases):
    got = _case(cases, "tp2")
    assert all(max(r) < 1e-5 for r in got["ranks"]) and got["d_weight"] < 1e-5, got
