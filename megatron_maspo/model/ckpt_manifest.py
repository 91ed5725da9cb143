"""A checkpoint's file list with sizes and checksums, written at save and verified before a resume.

A folder named ``step_<N>`` is complete when it was renamed into place, but a file in it can still be
damaged later (a truncated copy, a disk error, a partial rsync). ``manifest.json`` records every file's
size, and a SHA-256 of each file up to ``_HASH_LIMIT`` bytes (metadata, common state, RNG: where a flipped
byte is silent); the big tensor shards are caught by their size, which is what truncation changes,
without re-reading gigabytes at every save. Folders written before manifests existed are accepted as
they are (nothing to compare with).

Also here: the storage checks before training (writable run directory, free bytes) and the one-line
diagnosis of a save that failed because the disk filled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from megatron_maspo.errors import MissingPathError, StorageError

CHECKPOINT_SUBDIR = "checkpoints"
"""Checkpoints live in ``<checkpoint.run_dir>/checkpoints/step_<k>``."""
_STEP_DIR = re.compile(r"^step_(\d+)$")

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_HASH_LIMIT = 16 * 2**20
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_TEXT = ("No space left", "Disk quota", "File too large", "unexpected pos")
_reported: set[str] = set()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | Path) -> Path:
    """Record every file of ``folder`` (size; SHA-256 when small) in ``folder/manifest.json``."""
    folder = Path(folder)
    entries = {}
    for p in _files(folder):
        size = p.stat().st_size
        entries[str(p.relative_to(folder))] = {"size": size, **(
            {"sha256": _sha256(p)} if size <= _HASH_LIMIT else {})}
    out = folder / MANIFEST
    out.write_text(json.dumps({"version": 1, "files": entries}, indent=1, sort_keys=True))
    return out


def damage(folder: str | Path) -> str | None:
    """Why ``folder`` does not match its manifest (naming the file), or None when it does (or has none)."""
    folder = Path(folder)
    mf = folder / MANIFEST
    if not mf.is_file():
        return None
    try:
        entries = json.loads(mf.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{mf} is not a readable manifest"
    for rel, want in entries.items():
        p = folder / rel
        if not p.is_file():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{p} has {size} bytes, {want['size']} were written"
        if "sha256" in want and _sha256(p) != want["sha256"]:
            return f"{p} differs from what was written (SHA-256)"
    return None


def usable(ckpts: list[Path], root: str | Path) -> list[Path]:
    """``ckpts`` (oldest first) up to the newest undamaged one; each damaged newer one named once.

    Raises:
        MissingPathError: ``ckpts`` is not empty and every one of them is damaged (exit 2, one line).
    """
    for i in range(len(ckpts) - 1, -1, -1):
        why = damage(ckpts[i])
        if why is None:
            if i < len(ckpts) - 1 and str(ckpts[i]) not in _reported:
                _reported.add(str(ckpts[i]))
                logger.warning("resuming from %s, the newest complete checkpoint", ckpts[i])
            return ckpts[: i + 1]
        if str(ckpts[i]) not in _reported:
            _reported.add(str(ckpts[i]))
            logger.warning("checkpoint %s is damaged: %s", ckpts[i].name, why)
    if ckpts:
        raise MissingPathError(f"no complete checkpoint under {root}: every one is damaged (newest: "
                               f"{damage(ckpts[-1])})")
    return []


def check_storage(run_dir: str | Path, bytes_needed: int) -> None:
    """Before training: ``run_dir`` must be writable and its disk must have ``bytes_needed`` free.

    Raises:
        StorageError: one line naming the path and the bytes needed / free.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".maspo_write_probe_{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise StorageError(f"run directory {run_dir} is not writable ({e.strerror or e})") from None
    free = shutil.disk_usage(run_dir).free
    if free < bytes_needed:
        raise StorageError(f"run directory {run_dir}: {free / 2**20:.0f} MiB free, a checkpoint needs about "
                           f"{bytes_needed / 2**20:.0f} MiB ({bytes_needed} bytes; checkpoint.min_free_mb sets the figure)")


def folder_bytes(folder: str | Path) -> int:
    """Total size of the files under ``folder`` (a previous checkpoint: what the next one needs)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the disk or the file-size limit is full."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(t in str(e) for t in _FULL_TEXT):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def full_disk_error(final: Path, previous: Path | None) -> StorageError:
    """The one line for a save that failed because the disk filled."""
    free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
    kept = f"; the previous checkpoint {previous} is intact" if previous is not None else ""
    return StorageError(f"writing checkpoint {final} failed: no room (disk full, quota or file-size limit; "
                        f"{free} bytes free under {final.parent}){kept}")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]
