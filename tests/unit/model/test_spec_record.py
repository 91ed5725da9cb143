"""The layer spec travels with a checkpoint: recorded on save, rebuilt by conversion, checked on resume; the
default build no longer depends on whether Transformer Engine imports; MoE spec and config agree."""

from __future__ import annotations

import json

import pytest

from megatron_maspo.model import te_spec
from megatron_maspo.model.provider import ModelBuildOptions, moe_grouped_gemm, uses_te
from megatron_maspo.model.spec_record import (
    SPEC_FILE,
    build_fields,
    read_spec_record,
    spec_mismatch,
    spec_record,
    write_spec_record,
)


def test_default_options_build_the_local_spec_even_where_te_imports(monkeypatch):
    """Today's conversion left use_te=None and built TE wherever it imported, unlike the trainer."""
    monkeypatch.setattr(te_spec, "te_available", lambda: True)
    assert not uses_te(ModelBuildOptions())
    assert uses_te(ModelBuildOptions(use_te=None))  # explicit opt-in still probes
    assert uses_te(ModelBuildOptions(attention_backend="te"))


def test_moe_spec_and_config_agree_on_grouped_gemm():
    from megatron_maspo.model.moe import moe_transformer_kwargs
    from tests.unit.model.test_te_names import MOE

    for opts in (ModelBuildOptions(use_te=True), ModelBuildOptions()):
        kw = moe_transformer_kwargs(MOE, opts, grouped_gemm=moe_grouped_gemm(opts))
        assert kw["moe_grouped_gemm"] is uses_te(opts)


def test_record_round_trip_and_conversion_fields(tmp_path):
    write_spec_record(tmp_path, ModelBuildOptions(use_te=True))
    rec = read_spec_record(tmp_path)
    assert rec["layer_spec"] == "te" and rec["moe_grouped_gemm"] is True and rec["megatron_core"]
    assert build_fields(rec) == {"use_te": True, "attention_backend": "te"}
    assert build_fields(read_spec_record(tmp_path / "none")) == {"use_te": False, "attention_backend": "packed_sdpa"}
    assert spec_record(ModelBuildOptions(attention_backend="dense_mask"))["core_attention"] == "dense_mask"


def test_resume_with_another_spec_is_named_with_both(tmp_path):
    write_spec_record(tmp_path, ModelBuildOptions(use_te=True))
    msg = spec_mismatch(tmp_path, ModelBuildOptions())
    assert msg and "'layer_spec': 'te'" in msg and "this run builds {'layer_spec': 'local'" in msg
    assert spec_mismatch(tmp_path, ModelBuildOptions(use_te=True)) is None
    assert build_fields(read_spec_record(tmp_path), te_buildable=False) == {"use_te": False,
                                                                           "attention_backend": "packed_sdpa"}
    (tmp_path / SPEC_FILE).write_text(json.dumps({"layer_spec": "fancy"}))
    with pytest.raises(ValueError, match="layer_spec='fancy'"):
        read_spec_record(tmp_path)
