"""Bad inputs fail naming the tensor or constraint, and no output (or temp folder) is left behind."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_maspo.conversion.dist_ckpt import atomic_dir
from megatron_maspo.conversion.hf_to_megatron import HFSource, check_hf_keys
from megatron_maspo.conversion.jobs import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_maspo.conversion.megatron_to_hf import save_hf_folder
from megatron_maspo.model.hf_config import arch_spec_from_hf, hf_config_dict
from megatron_maspo.model.tiny_hf import make_tiny_hf_model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_tiny_hf_model("qwen3", d, vocab_size=301)
    return d, arch_spec_from_hf(d), load_file(str(d / "model.safetensors"))


def test_complete_checkpoint_passes(qwen3):
    d, spec, sd = qwen3
    with HFSource(d) as src:
        check_hf_keys(src, spec)
    check_hf_keys(HFSource(sd), spec)


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("model.layers.1.self_attn.k_norm.weight"),
     r"missing tensors \['model.layers.1.self_attn.k_norm.weight'\]"),
    (lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()),
     r"unexpected tensors \['lm_head.weight'\]"),
    (lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 63)),
     r"'model.layers.0.mlp.up_proj.weight' has shape \(128, 63\), expected \(128, 64\)"),
])
def test_bad_checkpoints_name_the_tensor(qwen3, tmp_path, edit, match):
    _, spec, sd = qwen3
    sd = dict(sd)
    edit(sd)
    with pytest.raises(ValueError, match=match):
        check_hf_keys(HFSource(sd), spec)
    save_file(sd, str(tmp_path / "model.safetensors"))  # the same through the lazy folder reader
    with HFSource(tmp_path) as src, pytest.raises(ValueError, match=match):
        check_hf_keys(src, spec)


def test_empty_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        HFSource(tmp_path)


def test_impossible_layout_and_unsupported_arch_leave_nothing(qwen3, tmp_path):
    d, _, _ = qwen3
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="num_query_groups=2 < tensor_model_parallel_size=4"):
        convert_hf_to_megatron(d, out, tp=4)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 given for a dense model"):
        convert_hf_to_megatron(d, out, ep=2)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}')
    with pytest.raises(ValueError, match="model_type='gemma3'"):
        convert_hf_to_megatron(bad, out)
    with pytest.raises(ValueError, match="not a megatron_maspo checkpoint"):
        convert_megatron_to_hf(bad, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_existing_output_is_not_overwritten(qwen3, tmp_path):
    d, _, _ = qwen3
    with pytest.raises(ValueError, match="already exists"):
        convert_hf_to_megatron(d, tmp_path)


def test_hf_writer_failure_leaves_no_partial_folder(qwen3, tmp_path):
    _, spec, sd = qwen3

    def stream():
        yield from list(sd.items())[:5]
        raise RuntimeError("rank died mid-export")

    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="mid-export"):
        save_hf_folder(stream(), out, hf_config_dict(spec), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_hf_writer_shards_and_reloads_bit_exact(qwen3, tmp_path):
    """Small shard limit: several files + index; transformers loads the folder; tensors identical."""
    import transformers

    d, spec, sd = qwen3
    out = save_hf_folder(iter(sd.items()), tmp_path / "hf", hf_config_dict(spec), max_shard_bytes=60_000,
                         progress=False)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref, _ = make_tiny_hf_model("qwen3", vocab_size=301)  # same seed -> same weights
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with HFSource(out) as src:
        check_hf_keys(src, spec)
        assert all(torch.equal(src.get(k), v) for k, v in sd.items())


def test_atomic_dir_cleans_up_on_error(tmp_path):
    with pytest.raises(KeyError), atomic_dir(tmp_path / "x") as tmp:
        (tmp / "f").write_text("partial")
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []
