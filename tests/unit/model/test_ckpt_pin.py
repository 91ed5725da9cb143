"""A pinned checkpoint stays readable after its trainer prunes it (real files and hard links)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from megatron_maspo.model.ckpt_manifest import list_checkpoints
from megatron_maspo.model.ckpt_pin import CheckpointVanished, pin, remove_stale_pins, unpin


def _ckpt(root, name="step_3"):
    ckpt = root / name
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"shard" * 100)
    (ckpt / "rng" / "rank0.safetensors").write_bytes(b"rng")
    return ckpt


def test_a_pinned_checkpoint_survives_its_pruning_and_is_never_listed(tmp_path):
    ckpt = _ckpt(tmp_path)
    snap = pin(ckpt)
    assert snap != ckpt and snap.parent == tmp_path and list_checkpoints(tmp_path) == [ckpt]
    shutil.rmtree(ckpt)  # the trainer's keep_last pruning
    assert (snap / "__0_0.distcp").read_bytes() == b"shard" * 100
    assert (snap / "rng" / "rank0.safetensors").read_bytes() == b"rng"
    unpin(snap)
    assert not snap.exists()
    with pytest.raises(CheckpointVanished, match="removed while being read"):
        pin(ckpt)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_unpin_leaves_a_checkpoint_read_in_place_alone(tmp_path):
    ckpt = _ckpt(tmp_path)
    unpin(ckpt)
    assert ckpt.is_dir()


def test_stale_pins_of_gone_processes_on_this_host_are_removed(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    host = socket.gethostname()
    gone = tmp_path / f".pinned-step_1@{host}-{p.pid}-abc123"
    live = tmp_path / f".pinned-step_1@{host}-{os.getpid()}-abc123"
    other = tmp_path / f".pinned-step_1@some-other-host-{p.pid}-abc123"
    for d in (gone, live, other):
        d.mkdir()
    remove_stale_pins(tmp_path)
    assert not gone.exists() and live.exists() and other.exists()
