"""A bad HF folder fails ``maspo convert hf-to-megatron`` with exit 2 and ONE line naming the file and
the tensor, before any rank starts, and leaves nothing behind; an input error raised inside a rank
reaches the caller as the same one-line error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_maspo.conversion.hf_to_megatron import HFSource
from megatron_maspo.conversion.jobs import hf_to_megatron_rank, run_job
from megatron_maspo.conversion.validate import read_header, validate_hf_folder
from megatron_maspo.errors import InputError
from megatron_maspo.model.hf_config import arch_spec_from_hf
from megatron_maspo.model.tiny_hf import make_tiny_hf_model

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    make_tiny_hf_model("qwen3", d, vocab_size=301)
    return d


def _edited(good: Path, tmp_path: Path, how: str) -> Path:
    bad = tmp_path / "bad_hf"
    shutil.copytree(good, bad)
    f = bad / "model.safetensors"
    if how == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) * 2 // 3])
        return bad
    sd = load_file(str(f))
    if how == "misshaped":
        sd[K_PROJ] = torch.zeros(sd[K_PROJ].shape[0] + 16, sd[K_PROJ].shape[1])
    elif how == "missing":
        del sd[K_PROJ]
    elif how == "int-dtype":
        sd[K_PROJ] = torch.zeros(sd[K_PROJ].shape, dtype=torch.int32)
    save_file(sd, str(f))
    return bad


CASES = [("misshaped", r"has shape \(\d+, \d+\), config.json implies"), ("missing", "missing tensor"),
         ("truncated", "truncated"), ("int-dtype", "dtype I32")]


@pytest.mark.parametrize("how,what", CASES)
def test_validation_names_file_and_tensor(good, tmp_path, how, what):
    bad = _edited(good, tmp_path, how)
    with pytest.raises(InputError, match=what) as e:
        validate_hf_folder(bad, arch_spec_from_hf(bad))
    msg = str(e.value)
    assert str(bad / "model.safetensors") in msg and "'model.layers." in msg and "\n" not in msg


def test_good_folder_passes_and_header_matches_the_library(good):
    validate_hf_folder(good, arch_spec_from_hf(good))
    header = read_header(good / "model.safetensors")
    with HFSource(good) as src:
        assert {k: tuple(v["shape"]) for k, v in header.items()} == {
            k: src.shape(k) for k in src.keys()}  # noqa: SIM118 (HFSource, not a dict)


def test_truncated_header_and_bad_index(tmp_path, good):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x10\x00")
    with pytest.raises(InputError, match=r"model.safetensors: truncated safetensors file \(2 bytes"):
        read_header(f)
    f.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(InputError, match="header of 1000 bytes, file of 10 bytes"):
        read_header(f)
    sharded = tmp_path / "sharded"
    shutil.copytree(good, sharded)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {K_PROJ: "model-00002.safetensors"}}))
    with pytest.raises(InputError, match=rf"model-00002.safetensors: missing; .* maps tensor '{K_PROJ}'"):
        validate_hf_folder(sharded, arch_spec_from_hf(good))


def test_reader_names_the_file_of_an_unreadable_safetensors(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes((40).to_bytes(8, "little") + b'{"x": {"dtype": "F32", "shape": [2], ')
    with pytest.raises(InputError, match=rf"{f}: unreadable safetensors file"):
        HFSource(tmp_path)


def _maspo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", *args], capture_output=True,
                          text=True, timeout=300, env=env)


# One CLI run per case costs a process start (torch + transformers imports): the validation of each
# case is covered above in-process, so only the first runs by default.
@pytest.mark.parametrize("how,what", [CASES[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in CASES[1:3])])
def test_cli_exits_2_with_one_line_and_leaves_nothing(good, tmp_path, how, what):
    bad = _edited(good, tmp_path, how)
    out = tmp_path / "out"
    res = _maspo("convert", "hf-to-megatron", "--hf", str(bad), "--out", str(out))
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("maspo convert: error: ") and str(bad / "model.safetensors") in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_hf"]


def test_input_error_inside_a_rank_becomes_one_error_and_no_output(good, tmp_path):
    # Skip the pre-spawn validation: the spawned rank's own check must report the same way.
    bad = _edited(good, tmp_path, "misshaped")
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"{bad / 'model.safetensors'}: HF tensor '{K_PROJ}' has shape") as e:
        run_job(hf_to_megatron_rank, 1, 1, 1, str(bad), str(out), 1, 1, 1, False, timeout_s=300)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_hf"]
