"""Model-only Megatron distributed checkpoints, written atomically (temp folder + rename).

The checkpoint is Megatron's ``torch_dist`` format (reshardable: save at one TP/PP/EP, load at
another) plus ``maspo_arch.json`` (the :class:`ArchSpec`) and, optionally, the HF tokenizer files
under ``hf_assets/`` so ``megatron-to-hf`` can rebuild a complete HF folder. The actor's training
checkpoint reuses :func:`atomic_dir` and these save/load functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_maspo.conversion.plan import unwrap
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.parallel import comm

logger = logging.getLogger(__name__)

ARCH_FILE = "maspo_arch.json"
ASSETS_DIR = "hf_assets"


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a fresh sibling temp folder; rename it to ``final`` on success, delete it on error.

    Single-process helper (collective saves use :func:`save_model_checkpoint`). ``final`` must not
    exist: overwriting a checkpoint in place is never atomic.
    """
    final = Path(final)
    if final.exists():
        raise ValueError(f"output path {final} already exists; refusing to overwrite")
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    models = [unwrap(c) for c in chunks]
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def save_model_checkpoint(chunks: list[torch.nn.Module], path: str | Path, spec: ArchSpec, *,
                          hf_assets: str | Path | None = None) -> Path:
    """Collective (all ranks of the default group): save the model chunks to ``path`` atomically.

    Rank 0 creates a temporary sibling folder, every rank writes its shards into it, and rank 0
    renames it to ``path`` after a barrier; on any failure the temporary folder is removed and
    ``path`` does not exist.
    """
    from megatron.core import dist_checkpointing

    final = Path(path)
    rank = dist.get_rank()
    box: list = [None]
    if rank == 0:
        try:
            if final.exists():
                raise ValueError(f"output path {final} already exists; refusing to overwrite")
            tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            box[0] = str(tmp)
        except Exception as e:  # tell the other ranks before raising, or they hang in the save
            box[0] = e
    box[0] = comm.broadcast_object(box[0], src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    tmp = Path(box[0])
    ok = True
    try:
        dist_checkpointing.save(_sharded_state_dict(chunks), str(tmp))
    except Exception:
        ok = False
        raise
    finally:
        flags = comm.all_gather_object(ok)
        if rank == 0:
            if all(flags):
                (tmp / ARCH_FILE).write_text(json.dumps(dataclasses.asdict(spec), indent=2))
                if hf_assets is not None:
                    from megatron_maspo.conversion.megatron_to_hf import copy_hf_assets

                    (tmp / ASSETS_DIR).mkdir()
                    copy_hf_assets(hf_assets, tmp / ASSETS_DIR)
                os.replace(tmp, final)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()
    if not all(flags):
        raise RuntimeError(f"dist-checkpoint save to {final} failed on ranks "
                           f"{[r for r, f in enumerate(flags) if not f]}")
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
    sharded = _sharded_state_dict(chunks)
    state = dist_checkpointing.load(sharded, str(path))
    models = [unwrap(c) for c in chunks]
    for i, m in enumerate(models):
        m.load_state_dict(state["model" if len(models) == 1 else f"model{i}"], strict=True)
    logger.info("loaded Megatron checkpoint %s", path)
