"""One run per run directory: a lock file, taken before ``maspo train`` writes anything there.

Two runs started into one ``checkpoint.run_dir`` would otherwise both train: ``config.yaml`` keeps the
later one, ``metrics.jsonl`` logs every step twice and the checkpoints are a mix of both. So the first
thing ``maspo train`` does with a run directory is create ``<run_dir>/.maspo_run.lock`` with
``O_CREAT | O_EXCL``, holding the host, pid and start time of the process that owns the run.

* **One lock per job**: global rank 0 takes it (``RANK`` unset or 0); the other ranks and nodes of the
  job write only what rank 0 tells them to (checkpoint shards into the folder rank 0 created).
* **Shared filesystems**: an exclusive create is atomic on a local disk and on NFS v3 and later (the
  server checks existence and creates in one operation), so two hosts racing for one directory on NFS
  get one winner. NFS v2 has no exclusive create; it is not supported.
* **Stale locks**: a holder on this host whose pid is gone (or reused by another process: its start
  time differs) left the lock behind when it was killed (SIGKILL, OOM, a node reboot); the lock is then
  taken over with a warning, so ``--resume`` after a kill just works. Only the holder of a second
  exclusive file, ``<lock>.takeover``, may delete a stale lock, so starters racing for one stale lock get
  one winner. A holder on another host cannot be
  checked from here: the refusal names it and the file to delete once that run is known to be gone.
  The exception is a Slurm job requeued onto another node (same ``SLURM_JOB_ID``, a higher
  ``SLURM_RESTART_COUNT``): the holder is this job's own earlier incarnation, which Slurm has ended.
* **Readers do not lock**: ``maspo eval`` of a running run reads its complete ``step_*`` folders.

The lock is released (deleted, if it is still ours) when the run ends, whatever the outcome; a run
directory the run created and left empty (a refusal before the first write) is removed with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from megatron_maspo.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)

LOCK_NAME = ".maspo_run.lock"


class RunDirLockedError(ConfigError):
    """Another live run holds the run directory (exit 2, one line naming its host and pid)."""


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), plus the boot
    id: together they tell a pid reused after the holder died from the holder itself. None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its closing one
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _holder_record() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "proc_start": _proc_start(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "slurm": _slurm_incarnation()}


def _slurm_incarnation() -> list[str] | None:
    job = os.environ.get("SLURM_JOB_ID")
    return [job, os.environ.get("SLURM_RESTART_COUNT", "0")] if job else None


def _read(lock: Path) -> dict | None:
    """The holder's record; None when the lock vanished meanwhile. An unreadable one (a holder killed
    between create and write) is treated as a holder that is gone on this host."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(text)
        return rec if isinstance(rec, dict) and isinstance(rec.get("pid"), int) else {}
    except ValueError:
        return {}


def _stale(rec: dict) -> bool:
    """Whether the holder is known to be gone: on this host, its pid dead or reused."""
    if not rec:
        return True
    mine, theirs = _slurm_incarnation(), rec.get("slurm")
    if mine and isinstance(theirs, list) and theirs[:1] == mine[:1] and theirs != mine:
        return True  # this Slurm job before its requeue: Slurm ended that incarnation
    if rec.get("host") != socket.gethostname():
        return False
    pid = rec["pid"]
    if not _alive(pid):
        return True
    now = _proc_start(pid)
    return rec.get("proc_start") is not None and now is not None and now != rec["proc_start"]


def _create(lock: Path, rec: dict) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(rec))
    return True


def _refusal(run_dir: Path, lock: Path, held: dict) -> RunDirLockedError:
    where = "this host" if held.get("host") == socket.gethostname() else f"host {held.get('host')}"
    hint = ("wait for it to end, or choose another checkpoint.run_dir" if where == "this host" else
            f"if that run is gone, delete {lock}; or choose another checkpoint.run_dir")
    return RunDirLockedError(f"run directory {run_dir} is in use by pid {held['pid']} on {where} "
                             f"(started {held.get('started', '?')}); {hint}")


def _take_over(lock: Path, held: dict, rec: dict) -> bool:
    """Replace the stale lock ``held`` by ``rec``; False when another starter is doing it or did it.

    Only the holder of ``<lock>.takeover`` (an exclusive create too) may delete the lock, and only after
    reading it again: several starters finding one stale lock cannot delete each other's new lock.
    """
    mutex = lock.with_name(lock.name + ".takeover")
    if not _create(mutex, rec):
        other = _read(mutex)
        if other is not None and _stale(other) and _read(mutex) == other:
            mutex.unlink(missing_ok=True)  # a starter killed mid-takeover (microseconds): free it
        time.sleep(0.05)
        return False
    try:
        if _read(lock) not in (held, None):
            return False  # replaced meanwhile: look again
        lock.unlink(missing_ok=True)
        return _create(lock, rec)
    finally:
        mutex.unlink(missing_ok=True)


def acquire(run_dir: str | Path) -> Path:
    """Take the run directory's lock (creating the directory); returns the lock file.

    Raises:
        RunDirLockedError: a live run holds it (one line: its host, pid, start time and what to do).
        StorageError: the run directory cannot be created or written.
    """
    run_dir = Path(run_dir)
    lock, rec = run_dir / LOCK_NAME, _holder_record()
    for _ in range(100):  # a takeover by another starter takes microseconds: look again
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if _create(lock, rec):
                return lock
        except OSError as e:  # read-only, no permission, not a folder: the storage check's wording
            raise StorageError(f"run directory {run_dir} is not writable ({e.strerror or e})") from None
        held = _read(lock)
        if held is None:
            continue
        if not _stale(held):
            raise _refusal(run_dir, lock, held)
        if _take_over(lock, held, rec):
            logger.warning("run directory %s: taking over the lock of pid %s on %s, which is no longer "
                           "running (killed?)", run_dir, held.get("pid", "?"), held.get("host", "this host"))
            return lock
    raise RunDirLockedError(f"run directory {run_dir}: could not take {lock} (other runs are starting "
                            "there at the same moment)")


def release(lock: Path) -> None:
    """Delete the lock if it is still this process's (a takeover may have replaced it)."""
    held = _read(lock)
    if held and held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def run_dir_lock(run_dir: str | Path, *, rank: int) -> Iterator[Path | None]:
    """Hold the run directory's lock for the block on rank 0; other ranks yield None (one lock per job)."""
    if rank != 0:
        yield None
        return
    created = not Path(run_dir).exists()
    lock = acquire(run_dir)
    try:
        yield lock
    finally:
        release(lock)
        if created:  # refused before writing anything (e.g. a preflight check): leave no empty folder
            with contextlib.suppress(OSError):
                Path(run_dir).rmdir()
