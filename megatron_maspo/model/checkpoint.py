"""One mechanism, shared by training and conversion, for model chunks in checkpoints.

* :func:`unwrap`: the ``GPTModel`` under DDP / Float16Module wrappers;
* :func:`model_sharded_state_dict` / :func:`load_model_state`: the Megatron sharded state dict of a
  list of chunks (``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` with virtual
  pipeline stages) and its strict load back;
* :func:`atomic_dir` (one process) and :func:`collective_atomic_dir` (every rank writes its part):
  a checkpoint is written into a hidden sibling folder and renamed into place only when complete,
  so a folder with the final name is always whole.

Used by ``train/actor/checkpoint.py`` (actor checkpoints: model, optimizer, RNG, data position) and by
``conversion/dist_ckpt.py`` / ``conversion/megatron_to_hf.py`` (model-only checkpoints, HF folders).
Megatron-Core is not imported here: the chunks' own ``sharded_state_dict`` does the work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_maspo.parallel import comm

logger = logging.getLogger(__name__)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (``.module``, possibly nested) down to the ``GPTModel``."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """Megatron sharded state dict of this rank's chunks (wrappers stripped), keyed ``model`` / ``model<i>``."""
    models = [unwrap(c) for c in chunks]
    return {_model_key(i, len(models)): m.sharded_state_dict() for i, m in enumerate(models)}


def load_model_state(chunks: list[torch.nn.Module], loaded: dict, *, strict: bool = True) -> None:
    """Load the ``model`` / ``model<i>`` entries of a ``dist_checkpointing.load`` result into the chunks."""
    models = [unwrap(c) for c in chunks]
    for i, m in enumerate(models):
        m.load_state_dict(loaded[_model_key(i, len(models))], strict=strict)


def _temp_sibling(final: Path, tmp_name: str | None) -> Path:
    return final.parent / (tmp_name or f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a fresh sibling temp folder; rename it to ``final`` on success, delete it on error.

    Single-process (collective saves use :func:`collective_atomic_dir`). ``final`` must not exist:
    overwriting a checkpoint in place is never atomic.
    """
    final = Path(final)
    if final.exists():
        raise ValueError(f"output path {final} already exists; refusing to overwrite")
    tmp = _temp_sibling(final, None)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def collective_atomic_dir(final: str | Path, *, overwrite: bool = False, tmp_name: str | None = None,
                          on_commit: Callable[[], None] | None = None) -> Iterator[Path]:
    """Collective over the default group: every rank writes its part into one temp folder, rank 0 renames it.

    Protocol: rank 0 checks ``final`` and creates the temp sibling (a stale one of the same name is
    removed), its path or its error is broadcast (so every rank raises the same error instead of
    hanging); every rank runs the body; a barrier; rank 0 replaces ``final`` (removing an existing
    one only with ``overwrite``) and calls ``on_commit`` (e.g. pruning older checkpoints); a barrier.

    After an error in the body no collective runs (the other ranks may be inside a collective of
    their own): the error propagates and the job's failure handling ends the other ranks. The temp
    folder is then left behind under a hidden name that is never taken for a checkpoint (with one
    process it is removed).

    Args:
        final: the checkpoint folder.
        overwrite: replace an existing ``final`` (training's step folders) instead of refusing.
        tmp_name: the temp folder's name (default: a unique ``.<name>.tmp-<hex>``).
        on_commit: run by rank 0 right after the rename, before the last barrier.
    """
    final = Path(final)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list = [None]
    if rank == 0:
        try:
            if final.exists() and not overwrite:
                raise ValueError(f"output path {final} already exists; refusing to overwrite")
            tmp = _temp_sibling(final, tmp_name)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            box[0] = str(tmp)
        except Exception as e:  # tell the other ranks before raising, or they wait in the save
            box[0] = e
    if world > 1:
        box[0] = comm.broadcast_object(box[0], src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    tmp = Path(box[0])
    try:
        yield tmp
    except BaseException:
        if world == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            logger.error("rank %d: writing %s failed; the partial folder %s is left behind", rank, final, tmp)
        raise
    if world > 1:
        comm.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if on_commit is not None:
            on_commit()
    if world > 1:
        comm.barrier()
