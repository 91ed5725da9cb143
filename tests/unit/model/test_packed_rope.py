"""Packed (thd) RoPE without TE runs no host sync per layer (issue 29, defect 8d): megatron-core's unfused
thd path calls ``cu_seqlens.tolist()`` (and compares with ``cu_seqlens[-1]``) on every call, i.e. for the
query and the key of every layer; with the host bounds the packed params carry, the per-token table is
built once per micro-batch and the result is bitwise Megatron's."""

from __future__ import annotations

import types

import torch

from megatron_maspo.model.packed_attention import build_packed_seq_params


class _Group:
    def size(self):
        return 1

    def rank(self):
        return 0


CFG = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                            mrope_section=None)


def _inputs(bounds, d=16, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(bounds[-1], heads, d, generator=g)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    freqs = torch.randn(longest, 1, 1, d, generator=g)
    return t, freqs


def _count_host_syncs(monkeypatch):
    calls = []
    for name in ("tolist", "item"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


def test_packed_rope_matches_megatron_without_a_host_sync(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    bounds = [0, 5, 12, 13, 20]
    params = build_packed_seq_params(bounds)  # tags cu_seqlens with the host bounds, installs the route
    t, freqs = _inputs(bounds)
    original = rope_utils._apply_rotary_pos_emb_thd.maspo_original
    want = original(t, params.cu_seqlens_q.clone(), freqs, cp_group=_Group())  # a tensor without bounds
    calls = _count_host_syncs(monkeypatch)
    outs = [rope_utils.apply_rotary_pos_emb(x, freqs, CFG, cu_seqlens=params.cu_seqlens_q, cp_group=_Group())
            for x in (t, t.clone(), t)]  # q and k of two "layers"
    assert calls == []  # no tolist / item: nothing waits for the device
    assert all(torch.equal(o, want) for o in outs)
    table = params.cu_seqlens_q._maspo_rope_cache[1]
    assert table.shape == (20, 1, 1, 16)  # built once for the micro-batch


def test_megatron_path_is_kept_where_the_host_bounds_are_missing(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    build_packed_seq_params([0, 3])  # installs
    bounds = [0, 4, 9]
    t, freqs = _inputs(bounds, seed=1)
    cu = torch.tensor(bounds, dtype=torch.int32)  # built by someone else: no host copy
    calls = _count_host_syncs(monkeypatch)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, CFG, cu_seqlens=cu, cp_group=_Group())
    assert "tolist" in calls  # Megatron's own function ran
    monkeypatch.undo()
    want = rope_utils._apply_rotary_pos_emb_thd.maspo_original(t, cu, freqs, cp_group=_Group())
    assert torch.equal(out, want)
