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


_BYTES_PER_PARAM = 16  # bf16/fp32 weights + fp32 master copy + Adam's two fp32 moments, rounded up
_CKPT_OVERHEAD = 16 * 2**20  # metadata, tokenizer files, RNG states


def free_bytes_needed(cfg, ckpts: list[Path]) -> int:
    """Bytes the run directory's disk must have free before training (``checkpoint.min_free_mb``).

    None (the default): the last checkpoint's size on a resume; on a fresh run an estimate of one
    checkpoint from the model's parameter count (the tiny model's, or the HF folder's config.json);
    64 MiB when neither is known here.
    """
    from megatron_maspo.model.ckpt_manifest import folder_bytes

    if cfg.checkpoint.min_free_mb is not None:
        return cfg.checkpoint.min_free_mb * 2**20
    if ckpts:
        return folder_bytes(ckpts[-1])
    params = _parameter_count(cfg.model)
    return params * _BYTES_PER_PARAM + _CKPT_OVERHEAD if params else 64 * 2**20


def _parameter_count(model) -> int | None:
    if model.source == "tiny":
        from megatron_maspo.data.tokenizer import build_byte_tokenizer
        from megatron_maspo.model.spec import tiny_qwen2_spec

        return tiny_qwen2_spec(vocab_size=len(build_byte_tokenizer()), num_layers=model.tiny_num_layers,
                               hidden_size=model.tiny_hidden_size).num_parameters()
    if (Path(model.source) / "config.json").is_file():
        from megatron_maspo.model.hf_config import arch_spec_from_hf

        try:
            return arch_spec_from_hf(model.source).num_parameters()
        except ValueError:
            return None  # the model build says what is wrong with it
    return None
