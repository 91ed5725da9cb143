"""megatron-core version differences kept in ``model/mcore_compat`` (issue 47). Runs on whichever
megatron-core the venv has (0.16.1 in CI's main stack, 0.19.x in the next-stack venv): the helpers probe
the installed signatures, and the packed-RoPE route accepts the MLA flag under both spellings."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_maspo.model import mcore_compat
from megatron_maspo.model.packed_attention import build_packed_seq_params


class _Group:
    def size(self):
        return 1

    def rank(self):
        return 0


def test_rope_mla_kwarg_is_a_parameter_of_the_installed_rope_functions():
    from megatron.core.models.common.embeddings import rope_utils

    name = mcore_compat.rope_mla_kwarg()
    assert name in (mcore_compat.ROPE_MLA_OLD, mcore_compat.ROPE_MLA_NEW)
    for fn in (rope_utils._apply_rotary_pos_emb_bshd, getattr(rope_utils._apply_rotary_pos_emb_thd,
                                                                "maspo_original",
                                                                rope_utils._apply_rotary_pos_emb_thd)):
        assert name in inspect.signature(fn).parameters
    assert mcore_compat.rope_mla_kwargs(1) == {name: True}


@pytest.mark.parametrize(("kwargs", "default", "want"), [
    ({}, False, False),
    ({}, True, True),
    ({"multi_latent_attention": True}, False, True),
    ({"mla_rotary_interleaved": True}, False, True),
    ({"multi_latent_attention": None, "mla_rotary_interleaved": True}, False, True),  # 0.19's None default
    ({"multi_latent_attention": False, "mla_rotary_interleaved": True}, False, False),  # old wins, as in 0.19
])
def test_pop_rope_mla_flag_reads_either_spelling(kwargs, default, want):
    kw = dict(kwargs, other=1)
    assert mcore_compat.pop_rope_mla_flag(kw, default=default) is want
    assert kw == {"other": 1}


@pytest.mark.parametrize("mla", [False, True])
def test_packed_rope_route_takes_the_mla_flag_under_both_spellings(mla):
    from megatron.core.models.common.embeddings import rope_utils

    bounds = [0, 5, 12, 20]
    params = build_packed_seq_params(bounds)  # installs the route
    g = torch.Generator().manual_seed(0)
    t = torch.randn(bounds[-1], 2, 8, generator=g)
    freqs = torch.randn(8, 1, 1, 8, generator=g)
    original = rope_utils._apply_rotary_pos_emb_thd.maspo_original
    want = original(t, params.cu_seqlens_q.clone(), freqs, cp_group=_Group(), **mcore_compat.rope_mla_kwargs(mla))
    route = rope_utils._apply_rotary_pos_emb_thd
    for cu in (params.cu_seqlens_q, params.cu_seqlens_q.clone()):  # host bounds (ours) / none (Megatron's)
        got = [route(t, cu, freqs, cp_group=_Group(), multi_latent_attention=mla),
               route(t, cu, freqs, cp_group=_Group(), mla_rotary_interleaved=mla),
               route(t, cu, freqs, False, mla, 1.0, _Group())]
        assert all(torch.equal(x, want) for x in got)
    with pytest.raises(TypeError, match="no_such_flag"):
        route(t, params.cu_seqlens_q, freqs, cp_group=_Group(), no_such_flag=True)


def _pickled_tensor_naming(loader: tuple[str, str]) -> bytes:
    """A protocol-3 pickle of a tensor whose storage loader global is ``loader`` (GLOBAL opcode rewritten)."""
    import pickle

    data = pickle.dumps({"scale_fwd": torch.ones(3)}, protocol=3)
    for old in (mcore_compat.TORCH_STORAGE_LOADER, mcore_compat.MCORE_STORAGE_LOADER):
        data = data.replace(f"c{old[0]}\n{old[1]}\n".encode(), f"c{loader[0]}\n{loader[1]}\n".encode())
    assert f"c{loader[0]}\n{loader[1]}\n".encode() in data
    return data


def test_extra_state_screen_admits_the_storage_loader_names_the_installed_version_writes():
    from megatron.core import safe_globals

    from megatron_maspo.errors import InputError
    from megatron_maspo.model.safe_load import screen_extra_state

    names = mcore_compat.storage_loader_globals()
    assert mcore_compat.TORCH_STORAGE_LOADER in names
    has_safe = callable(getattr(safe_globals, "safe_load_from_bytes", None))  # 0.19: yes; 0.16.1: no
    assert (mcore_compat.MCORE_STORAGE_LOADER in names) is has_safe
    for loader in (mcore_compat.TORCH_STORAGE_LOADER, mcore_compat.MCORE_STORAGE_LOADER):
        t = torch.frombuffer(bytearray(_pickled_tensor_naming(loader)), dtype=torch.uint8)
        if loader in names:
            screen_extra_state([t], "x")  # accepted
        else:  # 0.16.1 never writes megatron's name: refused as before
            with pytest.raises(InputError, match="names megatron.core.safe_globals.safe_load_from_bytes"):
                screen_extra_state([t], "x")


def test_core_attention_channel_kwargs_only_for_constructors_that_take_them():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_maspo.model.mcore_compat import core_attention_channel_kwargs
    from megatron_maspo.model.packed_attention import PackedSDPAttention

    assert core_attention_channel_kwargs(PackedSDPAttention, 192, 128) == {"k_channels": 192, "v_channels": 128}
    takes = "k_channels" in inspect.signature(DotProductAttention.__init__).parameters
    assert bool(core_attention_channel_kwargs(DotProductAttention, 192, 128)) == takes


def test_mla_sees_whether_transformer_engine_imported():
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    from megatron_maspo.model.mcore_compat import mla_without_te

    mla_without_te()
    if not te_ext.HAVE_TE:  # TE absent (CPU): MLA must not call isinstance with TE's MagicMock stand-in
        assert mla.HAVE_TE is False


def test_moe_router_without_te_binds_the_absent_gemm(monkeypatch):
    """0.16.1 without TE leaves ``moe_utils.te_general_gemm`` unbound and the router's ``is not None`` test
    raises NameError (seen on an H200 without TE): the shim binds None, and leaves a bound value alone."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    mcore_compat.moe_router_without_te()
    assert moe_utils.te_general_gemm is None
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel)
    mcore_compat.moe_router_without_te()
    assert moe_utils.te_general_gemm is sentinel
