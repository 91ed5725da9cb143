"""Read a running run's checkpoint while its trainer may delete it: a hard-linked snapshot.

``maspo eval`` of a run that is still training picks the newest complete ``step_N``, then spends seconds
building a model before it reads a byte; meanwhile the trainer saves again and prunes ``step_N``
(``checkpoint.keep_last``), and the load failed with ``FileNotFoundError``. A checkpoint's files are never
rewritten once its folder is renamed into place, so hard links to them pin that version: deleting the
folder then only drops the folder's names, and the linked files stay readable until the snapshot goes.

The snapshot is a hidden sibling (``.pinned-step_N@<host>-<pid>-<hex>``), which neither the checkpoint listing
nor the trainer's pruning ever takes for a checkpoint; it costs no space while ``step_N`` exists. Where
hard links are impossible (another filesystem semantics, a read-only run directory) the checkpoint is
read in place, as before. Pure file operations: no torch, no Megatron.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

PIN_PREFIX = ".pinned-"


class CheckpointVanished(FileNotFoundError):
    """The checkpoint was deleted while its snapshot was being linked (pick the newest one again)."""


def pin(ckpt: str | Path) -> Path:
    """Hard-link every file of ``ckpt`` into a new hidden sibling and return it; ``ckpt`` itself when
    links cannot be made there.

    Raises:
        CheckpointVanished: ``ckpt`` (or a file of it) disappeared meanwhile (nothing is left behind).
    """
    ckpt = Path(ckpt)
    snap = ckpt.parent / f"{PIN_PREFIX}{ckpt.name}@{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        files = [p for p in ckpt.rglob("*") if p.is_file()]
        if not files:
            raise FileNotFoundError(ckpt)
        for src in files:
            dst = snap / src.relative_to(ckpt)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    except FileNotFoundError:
        shutil.rmtree(snap, ignore_errors=True)
        raise CheckpointVanished(f"{ckpt} was removed while being read") from None
    except OSError as e:  # EPERM, EXDEV, EROFS, EMLINK...: read the folder itself
        shutil.rmtree(snap, ignore_errors=True)
        logger.debug("cannot pin %s (%s); reading it in place", ckpt, e)
        return ckpt
    return snap


def unpin(path: str | Path) -> None:
    """Remove a snapshot made by :func:`pin` (a checkpoint read in place is left alone)."""
    path = Path(path)
    if path.name.startswith(PIN_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_pins(root: str | Path) -> None:
    """Remove the snapshots left by processes of this host that are gone (an eval killed mid-load)."""
    host = socket.gethostname()
    for snap in Path(root).glob(f"{PIN_PREFIX}*"):
        try:
            where, pid, _ = snap.name.rsplit("@", 1)[1].rsplit("-", 2)
            if where != host:
                continue  # another host's process: not ours to judge
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(snap, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass
