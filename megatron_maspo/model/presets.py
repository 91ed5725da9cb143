"""Exact public architectures as :class:`ArchSpec` presets, for planning and cluster recipes.

A recipe names a preset in ``model.arch`` when the checkpoint's ``config.json`` is not readable from the
machine that plans or submits the job. Each family declares its presets (``model/families/<family>.py``:
``presets``, ``planning_layouts``), with the numbers of each model's Hugging Face ``config.json``; when a
local ``config.json`` exists, ``arch_spec_from_hf`` is authoritative and the two should agree. The two
lists here are views of the family registry.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

from megatron_maspo.model.families.declaration import SpecFields
from megatron_maspo.model.families.registry import LiveMapping, families
from megatron_maspo.model.spec import ArchSpec

__all__ = ["PLANNING_LAYOUTS", "PRESETS", "get_preset"]


def _build(family: str, fields: SpecFields) -> ArchSpec:
    return ArchSpec(family=family, **copy.deepcopy(dict(fields)))  # fresh: callers may edit the spec


PRESETS: LiveMapping[Callable[[], ArchSpec]] = LiveMapping(
    lambda: {n: partial(_build, f.name, kw) for f in families() for n, kw in f.presets.items()})
"""Published checkpoints by lower-case HF name -> a builder of a fresh :class:`ArchSpec`."""

PLANNING_LAYOUTS: LiveMapping[Callable[[], ArchSpec]] = LiveMapping(
    lambda: {n: partial(_build, f.name, kw) for f in families() for n, kw in f.planning_layouts.items()})
"""Layouts that are no published checkpoint (no HF round trip): ``model.arch`` for ``maspo plan`` only."""


def get_preset(name: str) -> ArchSpec:
    """A fresh :class:`ArchSpec` for preset ``name`` (case-insensitive).

    Raises:
        ValueError: unknown name, listing the accepted ones.
    """
    key = name.lower()
    known = {**PRESETS, **PLANNING_LAYOUTS}
    if key not in known:
        raise ValueError(f"model.arch={name!r} is not a known preset; accepted: {sorted(known)}")
    return known[key]()
