"""``maspo convert tiny-hf`` writes the tiny HF model of any family; missing extras are named up front."""

from __future__ import annotations

import json

import pytest

from megatron_maspo.cli.convert import TINY_FAMILIES, require_extra
from megatron_maspo.cli.main import main
from megatron_maspo.errors import MissingExtraError
from megatron_maspo.model.tiny_hf import TINY_DEFAULTS


def test_the_cli_lists_every_tiny_family():
    assert sorted(TINY_FAMILIES) == sorted(TINY_DEFAULTS)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tiny_hf_writes_a_folder_the_converter_reads(tmp_path, family, capsys):
    out = tmp_path / family
    assert main(["convert", "tiny-hf", "--family", family, "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    assert (out / "model.safetensors").is_file()
    assert f"maspo convert hf-to-megatron --hf {out}" in capsys.readouterr().out
    assert main(["convert", "tiny-hf", "--family", family, "--out", str(out)]) == 2  # never overwrites


def test_a_missing_extra_is_one_line_naming_it():
    with pytest.raises(MissingExtraError) as e:
        require_extra("smollm2", ("json", "no_such_module_for_maspo"))
    assert str(e.value) == ("needs the smollm2 extra (missing: no_such_module_for_maspo): "
                            "pip install 'megatron-maspo[smollm2]'")


def test_convert_smollm2_without_the_extra_refuses_before_any_download(tmp_path, monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("gguf") or importlib.util.find_spec("accelerate"):
        pytest.skip("the smollm2 extra is installed here")
    monkeypatch.setenv("MASPO_CACHE", str(tmp_path / "cache"))
    assert main(["convert", "smollm2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["maspo convert: error: needs the smollm2 extra (missing: gguf, accelerate): "
                   "pip install 'megatron-maspo[smollm2]'"], err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()  # nothing fetched
