"""The layer spec that built a checkpoint, recorded beside it (``maspo_layer_spec.json``).

The local and Transformer Engine specs name the same weights differently in memory
(``input_layernorm.weight`` vs ``self_attention.linear_qkv.layer_norm_weight``; grouped-GEMM experts
``linear_fc1.weight{j}``, ``model/te_names.py``). Megatron maps the dense names to one sharded key
(the local spec's ``sharded_state_dict_keys_map``), but TE modules add ``_extra_state`` entries and loads are
strict, so a checkpoint carries the spec it was written with: conversion builds that spec (the local one
where TE cannot be built: its keys are the ones Megatron maps), and a resume whose options build another
spec logs both and, if the load fails, names both in the error instead of a missing key:

    {"layer_spec": "local" | "te", "core_attention": "packed_sdpa" | "dense_mask" | "te",
     "moe_grouped_gemm": bool, "megatron_core": "0.16.1"}

A checkpoint without the file was written before the record existed, by the local spec (the only spec
the trainer built by default); readers assume that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPEC_FILE = "maspo_layer_spec.json"
LEGACY = {"layer_spec": "local", "core_attention": "packed_sdpa", "moe_grouped_gemm": False}
"""What a checkpoint without :data:`SPEC_FILE` was built with."""


def spec_record(opts: Any) -> dict:
    """The record of the spec ``opts`` (a ``ModelBuildOptions``) builds."""
    from megatron_maspo.model.provider import moe_grouped_gemm, uses_te

    try:
        from megatron_maspo.model.mcore_compat import megatron_core_version

        mcore = megatron_core_version()
    except Exception:  # pragma: no cover - megatron-core is a hard dependency
        mcore = "unknown"
    te = uses_te(opts)
    return {"layer_spec": "te" if te else "local", "core_attention": "te" if te else opts.attention_backend,
            "moe_grouped_gemm": moe_grouped_gemm(opts), "megatron_core": mcore}


def write_spec_record(ckpt_dir: str | Path, opts: Any) -> Path:
    """Write :data:`SPEC_FILE` for ``opts`` into ``ckpt_dir`` (call on one rank, inside the atomic save)."""
    path = Path(ckpt_dir) / SPEC_FILE
    path.write_text(json.dumps(spec_record(opts), indent=2) + "\n")
    return path


def read_spec_record(ckpt_dir: str | Path) -> dict:
    """The recorded spec of ``ckpt_dir`` (:data:`LEGACY` when the file is absent).

    Raises:
        ValueError: the file is not a record (bad JSON or an unknown ``layer_spec``).
    """
    path = Path(ckpt_dir) / SPEC_FILE
    if not path.is_file():
        return dict(LEGACY)
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if rec.get("layer_spec") not in ("local", "te"):
        raise ValueError(f"{path}: layer_spec={rec.get('layer_spec')!r}; accepted: 'local', 'te'")
    return rec


def build_fields(rec: dict, *, te_buildable: bool = True) -> dict:
    """``ModelBuildOptions`` fields that rebuild the recorded spec (conversion jobs); the local spec when the
    record says TE but TE cannot be built here (``te_buildable=False``)."""
    te = rec["layer_spec"] == "te" and te_buildable
    attention = rec.get("core_attention", "packed_sdpa")
    return {"use_te": te, "attention_backend": "te" if te else ("packed_sdpa" if attention == "te" else attention)}


def spec_mismatch(ckpt_dir: str | Path, opts: Any) -> str | None:
    """A one-line description when ``opts`` builds another layer spec than the one that wrote ``ckpt_dir``,
    else None (core attention may differ: it has no parameters)."""
    rec = read_spec_record(ckpt_dir)
    mine = spec_record(opts)
    keys = ("layer_spec", "moe_grouped_gemm")
    if all(rec.get(k, LEGACY[k]) == mine[k] for k in keys):
        return None
    theirs = {k: rec.get(k, LEGACY[k]) for k in keys}
    return (f"checkpoint {ckpt_dir} was written by the {theirs} layer spec ({SPEC_FILE}); this run builds "
            f"{({k: mine[k] for k in keys})}: set model.attention_backend to match ('te' for the TE spec), or "
            "convert the checkpoint through HF")
