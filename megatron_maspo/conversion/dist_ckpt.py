"""Model-only Megatron distributed checkpoints, written atomically (temp folder + rename).

The checkpoint is Megatron's ``torch_dist`` format (reshardable: save at one TP/PP/EP, load at
another) plus ``maspo_arch.json`` (the :class:`ArchSpec`), ``maspo_layer_spec.json`` (the layer spec that built it) and, optionally, the HF tokenizer files
under ``hf_assets/`` so ``megatron-to-hf`` can rebuild a complete HF folder. The atomic-save protocol and
the sharded state dict are :mod:`megatron_maspo.model.checkpoint`'s, shared with the actor's training
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from megatron_maspo.conversion.megatron_to_hf import copy_hf_assets
from megatron_maspo.model.checkpoint import (
    atomic_dir,
    collective_atomic_dir,
    load_model_state,
    model_sharded_state_dict,
)
from megatron_maspo.model.provider import ModelBuildOptions
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.model.spec_record import write_spec_record

logger = logging.getLogger(__name__)

ARCH_FILE = "maspo_arch.json"
ASSETS_DIR = "hf_assets"

__all__ = ["ARCH_FILE", "ASSETS_DIR", "atomic_dir", "load_arch_spec", "load_model_checkpoint",
           "save_model_checkpoint"]


def save_model_checkpoint(chunks: list[torch.nn.Module], path: str | Path, spec: ArchSpec, *,
                          hf_assets: str | Path | None = None, opts: Any = None) -> Path:
    """Collective (all ranks of the default group): save the model chunks to ``path`` atomically.

    Every rank writes its shards into one temporary sibling folder, rank 0 adds the architecture
    (and the HF tokenizer files, and the layer spec ``opts`` builds: ``model/spec_record.py``; None = the
    local spec) and renames it to ``path`` (:func:`collective_atomic_dir`); an
    existing ``path`` is refused.
    """
    from megatron.core import dist_checkpointing

    final = Path(path)
    with collective_atomic_dir(final) as tmp:
        dist_checkpointing.save(model_sharded_state_dict(chunks), str(tmp))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            (tmp / ARCH_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2))
            write_spec_record(tmp, opts if opts is not None else ModelBuildOptions())
            if hf_assets is not None:
                (tmp / ASSETS_DIR).mkdir()
                copy_hf_assets(hf_assets, tmp / ASSETS_DIR)
    logger.info("saved Megatron checkpoint %s", final)
    return final


def load_arch_spec(path: str | Path) -> ArchSpec:
    """The :class:`ArchSpec` stored next to a checkpoint by :func:`save_model_checkpoint`."""
    f = Path(path) / ARCH_FILE
    if not f.is_file():
        raise ValueError(f"{path} is not a megatron_maspo checkpoint (no {ARCH_FILE})")
    return ArchSpec(**json.loads(f.read_text()))


def load_model_checkpoint(chunks: list[torch.nn.Module], path: str | Path) -> None:
    """Collective: load a checkpoint saved at any TP/PP/EP into these chunks (strict key match)."""
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").is_file():
        raise ValueError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    from megatron_maspo.model.safe_load import screen_checkpoint_once

    screen_checkpoint_once(Path(path))  # torch would unpickle .metadata unrestricted: screen it first
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), str(path))
    load_model_state(chunks, state, strict=True)
    logger.info("loaded Megatron checkpoint %s", path)
