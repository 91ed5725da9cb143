"""The srun-native Slurm launch's rank environment: torch.distributed's variables from Slurm's.

Torch-free, so the launcher that sets the switch (``launch/nemo_run.py``) and the process that reads it
(``train/process/distributed.py``) share it without the launcher importing the trainer.
"""

from __future__ import annotations

# Set by the srun-native Slurm launch (``launch/nemo_run.py``): each task derives RANK / WORLD_SIZE /
# LOCAL_RANK from Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (see rank_env_from_slurm); the
# batch script exports MASTER_ADDR (the first node's IP) and MASTER_PORT.
SRUN_RANKS_ENV = "MASPO_RANKS_FROM_SLURM"


def rank_env_from_slurm(env: dict[str, str]) -> dict[str, str]:
    """torch.distributed's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` from an srun task's environment.

    Empty unless the launcher asked for it (``MASPO_RANKS_FROM_SLURM=1``) and torchrun did not already
    set ``WORLD_SIZE``: an interactive ``salloc`` shell also carries SLURM_* variables and must stay a
    one-process run. ``MASTER_ADDR`` / ``MASTER_PORT`` come from the batch script.

    Raises:
        ValueError: asked for, but a SLURM_* or MASTER_* variable is missing.
    """
    if env.get(SRUN_RANKS_ENV) != "1" or "WORLD_SIZE" in env:
        return {}
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")
               if k not in env]
    if missing:
        raise ValueError(f"{SRUN_RANKS_ENV}=1 but {', '.join(missing)} unset: start the task with srun "
                         "inside an allocation whose batch script exports MASTER_ADDR and MASTER_PORT")
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"]}
