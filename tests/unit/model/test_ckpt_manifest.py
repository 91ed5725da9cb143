"""Checkpoint manifests: damage is found and named, resume falls back, storage problems are one line."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from megatron_maspo.errors import MissingPathError, StorageError
from megatron_maspo.model.ckpt_manifest import (
    check_storage,
    damage,
    disk_full,
    full_disk_error,
    usable,
    write_manifest,
)


def _ckpt(root, step: int):
    d = root / f"step_{step}"
    (d / "rng").mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m" * 100)
    (d / "__0_0.distcp").write_bytes(os.urandom(4096))
    (d / "rng" / "rank0.safetensors").write_bytes(b"r" * 64)
    write_manifest(d)
    return d


def test_an_intact_folder_matches_and_a_folder_without_manifest_is_accepted(tmp_path):
    d = _ckpt(tmp_path, 1)
    assert damage(d) is None
    (d / "manifest.json").unlink()
    assert damage(d) is None  # written before manifests existed


@pytest.mark.parametrize("harm, fragment", [
    (lambda d: os.truncate(d / "__0_0.distcp", 100), "__0_0.distcp has 100 bytes, 4096 were written"),
    (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    (lambda d: (d / "rng" / "rank0.safetensors").write_bytes(b"x" * 64), "rank0.safetensors differs"),
])
def test_damage_names_the_file(tmp_path, harm, fragment):
    d = _ckpt(tmp_path, 1)
    harm(d)
    assert fragment in damage(d)


def test_resume_falls_back_to_the_newest_complete_one_and_says_so(tmp_path, caplog):
    ckpts = [_ckpt(tmp_path, s) for s in (1, 2, 3)]
    os.truncate(ckpts[2] / "__0_0.distcp", 10)
    with caplog.at_level(logging.WARNING):
        assert usable(ckpts, tmp_path) == ckpts[:2]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"checkpoint step_3 is damaged: {ckpts[2] / '__0_0.distcp'} has 10 bytes, 4096 were "
                     "written", f"resuming from {ckpts[1]}, the newest complete checkpoint"], lines


def test_none_complete_is_one_line(tmp_path):
    ckpts = [_ckpt(tmp_path, s) for s in (1, 2)]
    for d in ckpts:
        (d / ".metadata").unlink()
    with pytest.raises(MissingPathError, match="no complete checkpoint under .*every one is damaged") as e:
        usable(ckpts, tmp_path)
    assert "\n" not in str(e.value)
    assert usable([], tmp_path) == []


def test_storage_checks_name_the_path_and_bytes(tmp_path):
    check_storage(tmp_path / "new", 1)
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # the probe is gone
    with pytest.raises(StorageError, match=rf"run directory {tmp_path}: \d+ MiB free, a checkpoint needs "
                                           rf"about \d+ MiB \({2**60} bytes; checkpoint.min_free_mb sets the figure\)"):
        check_storage(tmp_path, 2**60)
    ro = "/sys/maspo_write_test"  # a read-only mount here (root ignores file modes, not a ro mount)
    try:  # root ignores file modes, so only a read-only mount can refuse it
        os.mkdir(ro)
        os.rmdir(ro)
        pytest.skip("no read-only mount to try")
    except OSError:
        pass
    with pytest.raises(StorageError, match=f"run directory {ro} is not writable"):
        check_storage(ro, 1)


def test_a_full_disk_during_a_save_is_recognised(tmp_path):
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("worker failure")
    wrapped.__cause__ = OSError(errno.EFBIG, "File too large")
    assert disk_full(wrapped) and not disk_full(ValueError("bad shape"))
    msg = str(full_disk_error(tmp_path / "step_3", tmp_path / "step_2"))
    assert msg.startswith(f"writing checkpoint {tmp_path / 'step_3'} failed: no room") and \
        msg.endswith(f"the previous checkpoint {tmp_path / 'step_2'} is intact"), msg
