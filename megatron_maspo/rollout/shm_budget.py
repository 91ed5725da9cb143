"""Host shared memory a vLLM engine of the rollout pool stages weight syncs into, and what a node offers.

With ``rollout.placement=disaggregated``, ``rollout.engine=vllm`` and ``rollout.weight_transport=ipc``, each
engine owner receives every sync into host shared memory (``/dev/shm``: ``rollout/pool_sync.py``,
``rollout/transport.py::StagingPool``) so its workers map the buckets without a copy. The receiver lands
sync v+1 while the engine applies sync v, so an owner holds about **two syncs** of the model's bytes in
the engine dtype; a node needs that once per engine owner on it. Docker gives a container 64 MB of
``/dev/shm`` unless told otherwise, so the first sync would die with a bus error or ``No space left``.

Pure arithmetic plus one ``os.statvfs``: ``maspo check`` prints the planned figure per node,
``maspo doctor`` compares it with this machine's free ``/dev/shm``; both name the fix (:func:`shm_fix`).
"""

from __future__ import annotations

import math
import os

STAGED_SYNCS = 2
"""Syncs an owner holds at once: one being applied, the next landing (``rollout/pool_sync.py``)."""
SHM_PATH = "/dev/shm"


def uses_shm(rollout) -> bool:
    """True when the job's engine owners stage syncs in host shared memory (``rollout`` section)."""
    from megatron_maspo.rollout.engines import stages_in_shared_memory

    return stages_in_shared_memory(rollout)


def staging_bytes(sync_bytes: int, owners_on_node: int) -> int:
    """``/dev/shm`` bytes a node needs: ``STAGED_SYNCS`` syncs of ``sync_bytes`` per engine owner on it."""
    return STAGED_SYNCS * sync_bytes * owners_on_node


def shm_fix(need_bytes: int) -> str:
    """The container settings that give a node ``need_bytes`` of ``/dev/shm`` (rounded up, 10% headroom)."""
    gb = max(1, math.ceil(need_bytes * 1.1 / 2**30))
    return (f"run the container with --ipc=host (the host's /dev/shm, half its RAM by default) or "
            f"docker run --shm-size={gb}g; or set rollout.weight_transport=bytes (no shared staging, a copy "
            f"per bucket)")


def shm_free_bytes(path: str = SHM_PATH) -> int | None:
    """Free bytes of the filesystem at ``path`` (``os.statvfs``), or None when it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shm_verdict(need_bytes: int, free_bytes: int | None) -> tuple[bool, str]:
    """``(ok, line)``: ``free_bytes`` of ``/dev/shm`` against the node's ``need_bytes``, with the fix."""
    need = f"{need_bytes / 2**30:.1f} GiB"
    if free_bytes is None:
        return False, f"no {SHM_PATH} here, the staging needs {need}: {shm_fix(need_bytes)}"
    have = f"{free_bytes / 2**30:.1f} GiB free in {SHM_PATH}"
    if free_bytes >= need_bytes:
        return True, f"{have}, the staging needs {need}"
    return False, f"{have}, the staging needs {need}: {shm_fix(need_bytes)}"
