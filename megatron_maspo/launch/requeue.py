"""Auto-resume and self-requeue: what lets a Slurm job be stopped and started again with the same command.

A requeued Slurm job reruns its batch script unchanged, so the training command cannot say ``--resume``.
With ``checkpoint.auto_resume`` the trainer resumes whenever the run directory already holds a complete
checkpoint. Preemption and ``scontrol requeue`` requeue the job themselves (SIGTERM, then the job goes
back to the queue); the time-limit warning (``--signal=USR1@N``) does not, so after a run that stopped
early rank 0 asks Slurm to requeue its own job.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_maspo.config import MaspoConfig

logger = logging.getLogger(__name__)

REQUEUE_ENV = "MASPO_SLURM_REQUEUE"
"""Set to 1 by ``maspo launch --executor slurm`` when the job was submitted requeueable."""


def latest_step(run_dir: str | Path) -> int:
    """Step of the run directory's latest complete checkpoint (0 when it holds none)."""
    from megatron_maspo.model.ckpt_manifest import CHECKPOINT_SUBDIR, list_checkpoints

    ckpts = list_checkpoints(Path(run_dir) / CHECKPOINT_SUBDIR)
    return int(ckpts[-1].name.removeprefix("step_")) if ckpts else 0


def auto_resume(cfg: MaspoConfig) -> bool:
    """True when ``checkpoint.auto_resume`` is on and the run directory holds a complete checkpoint."""
    if not cfg.checkpoint.auto_resume:
        return False
    step = latest_step(cfg.checkpoint.run_dir)
    if step:
        logger.warning("checkpoint.auto_resume: resuming %s from its checkpoint at step %d",
                       cfg.checkpoint.run_dir, step)
    return step > 0


def requeue_if_unfinished(cfg: MaspoConfig, env: dict[str, str] | None = None) -> bool:
    """On rank 0 of a requeueable Slurm job whose run stopped before ``train.steps``: ``scontrol requeue``.

    Returns whether a requeue was requested. A failed request (e.g. the job is already being requeued
    after a preemption) is logged, not raised: the checkpoint is safe either way.
    """
    env = dict(os.environ) if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not (job and env.get(REQUEUE_ENV) == "1" and cfg.checkpoint.auto_resume):
        return False
    if env.get("RANK", "0") != "0":
        return False
    done = latest_step(cfg.checkpoint.run_dir)
    if done >= cfg.train.steps:
        return False
    logger.warning("stopped at step %d of %d: requeueing Slurm job %s", done, cfg.train.steps, job)
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        # After a preemption or `scontrol requeue` Slurm has already put the job back ("pending execution").
        already = "pending" in r.stderr.lower()
        logger.warning("scontrol requeue %s: %s", job, "the job is already requeued" if already else
                       f"failed ({r.stderr.strip()}); resubmit the same command to continue")
        return False
    return True
