"""Checks that run before anything heavy is imported or built: the run directory and the layout.

Cheap (a directory listing, a few integers), and free of megatron-core, so ``maspo train`` refuses a wrong
``checkpoint.run_dir`` or an unsupported layout in a second, not after a model build. The layout check
lives in ``parallel/layout_check.py`` (the planner asks it too) and is re-exported here.
"""

from __future__ import annotations

from pathlib import Path

from megatron_maspo.errors import ConfigError, MissingPathError
from megatron_maspo.model.ckpt_manifest import list_checkpoints, usable
from megatron_maspo.parallel.layout_check import check_layout_supported as check_layout_supported
from megatron_maspo.train.config import CHECKPOINT_SUBDIR


def check_run_dir(run_dir: str | Path, *, resume: bool) -> list[Path]:
    """The run directory's complete checkpoints, or a one-line error when they contradict ``resume``.

    Cheap (a directory listing): run it before building anything, so a wrong ``checkpoint.run_dir``
    costs a second, not a model build.

    Raises:
        ConfigError: a fresh run (no ``resume``) whose run directory already holds checkpoints.
        MissingPathError: ``resume`` and no complete checkpoint under the run directory (or every one
            is damaged: ``model/ckpt_manifest.py``; a damaged newest one is named and skipped).
    """
    ckpts = list_checkpoints(Path(run_dir) / CHECKPOINT_SUBDIR)
    if resume:
        ckpts = usable(ckpts, Path(run_dir) / CHECKPOINT_SUBDIR)
    if resume and not ckpts:
        raise MissingPathError(f"--resume: no complete checkpoint under {run_dir}/{CHECKPOINT_SUBDIR}")
    if not resume and ckpts:
        raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume {run_dir} "
                          "or choose another checkpoint.run_dir")
    return ckpts
