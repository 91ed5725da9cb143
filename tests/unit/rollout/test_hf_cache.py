"""``forward_with_cache`` passes the KV cache under the name the model's ``forward`` declares and reads it
back from the output field of that name: ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24
(where the old name logs a deprecation on every run). Real transformers models; the 5.24 signature is a
real module declaring ``cache`` around the installed model."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout.builtin_engine import _new_cache
from megatron_maspo.rollout.hf_cache import cache_argument, forward_with_cache


class _CacheNamed(torch.nn.Module):
    """The transformers >= 5.24 calling convention (``cache=`` in, ``.cache`` out) over a real model."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, cache=None, **kwargs):
        assert "past_key_values" not in kwargs
        out = self.inner(input_ids=input_ids, past_key_values=cache, **kwargs)
        return SimpleNamespace(logits=out.logits, cache=out.past_key_values)


def _decode_two(model) -> tuple[torch.Tensor, object]:
    cache = _new_cache(model.config)
    out, cache = forward_with_cache(model, cache, input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    out, cache = forward_with_cache(model, cache, input_ids=nxt, use_cache=True)
    return out.logits[:, -1], cache


def test_the_installed_model_and_the_renamed_signature_give_the_same_decode():
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    model.eval()
    renamed = _CacheNamed(model)
    assert cache_argument(renamed) == "cache"
    import inspect

    want = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_argument(model) == want
    with torch.no_grad():
        a, cache_a = _decode_two(model)
        b, cache_b = _decode_two(renamed)
    assert torch.equal(a, b)
    assert cache_a.get_seq_length() == cache_b.get_seq_length() == 4  # the cache came back and grew
