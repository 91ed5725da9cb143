"""What a resume takes from the checkpoint's lr schedule (progress) and from the config (settings)."""

from __future__ import annotations

from megatron_maspo.train.actor.checkpoint import scheduler_changes


def test_only_changed_settings_are_reported_and_progress_is_not_a_setting():
    ckpt = {"max_lr": 3e-4, "min_lr": 0.0, "lr_decay_steps": 8, "lr_decay_style": "constant", "num_steps": 8}
    cfg = {"max_lr": 1e-4, "min_lr": 0.0, "lr_decay_steps": 12, "lr_decay_style": "constant", "num_steps": 0}
    assert scheduler_changes(cfg, ckpt) == {"max_lr": (3e-4, 1e-4), "lr_decay_steps": (8, 12)}
    assert scheduler_changes(ckpt, ckpt) == {}
