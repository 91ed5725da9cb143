"""Published-layout Qwen3.5 wrapper checkpoints (tiny, built by transformers): the text model split out
loads as ``Qwen3_5(Moe)ForCausalLM`` with the wrapper's logits and maps onto our spec; joined back it
equals the original bit for bit, vision tensors and fused experts included."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_maspo.conversion.qwen3_5_wrapper import join_wrapper, split_wrapper
from megatron_maspo.model.families.registry import get_family

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2)
CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _wrapper(tmp_path, family):
    import transformers

    cfg = transformers.AutoConfig.for_model(family, text_config=dict(get_family(family).tiny, vocab_size=301),
                                            vision_config=VISION)
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(cfg).eval()
    model.save_pretrained(tmp_path / "wrapper")
    return model, tmp_path / "wrapper"


def _fuse_experts(src, dst):
    """The published MoE layout: per-expert keys fused into gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    out, groups = {}, {}
    for k, v in sd.items():
        if ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, w = rest.split(".")[:2]
            groups.setdefault(pre, {}).setdefault(int(e), {})[w] = v
        else:
            out[k] = v
    for pre, experts in groups.items():
        ids = sorted(experts)
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids])
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("family,fused", [("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_5_moe", True)])
def test_split_and_join(tmp_path, family, fused):
    import transformers

    from megatron_maspo.conversion.plan import hf_state_dict_keys
    from megatron_maspo.model.hf_config import arch_spec_from_hf

    wrapper, src = _wrapper(tmp_path, family)
    if fused:
        src = _fuse_experts(src, tmp_path / "fused")
    left = split_wrapper(src, tmp_path / "text")
    assert left and all(n.startswith("model.visual.") for n in left)
    spec = arch_spec_from_hf(tmp_path / "text")
    text_keys = {k for f in (tmp_path / "text").glob("*.safetensors") for k in load_file(str(f))}
    assert text_keys == set(hf_state_dict_keys(spec))
    tokens = torch.randint(0, 301, (2, 11), generator=torch.Generator().manual_seed(1))
    text_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(text_model(input_ids=tokens).logits, wrapper(input_ids=tokens).logits, atol=1e-6)
    join_wrapper(tmp_path / "text", src, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["text_config"] == \
        json.loads((src / "config.json").read_text())["text_config"]


def test_not_a_wrapper_is_refused(tmp_path):
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    make_tiny_hf_model("qwen3_5", tmp_path / "plain")
    with pytest.raises(ValueError, match="model_type='qwen3_5_text' with text_config expected"):
        split_wrapper(tmp_path / "plain", tmp_path / "out")
