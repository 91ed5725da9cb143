"""``maspo convert megatron-to-hf`` on a checkpoint carrying a code-running pickle: refused before any rank
starts, in one line naming the file, with no code run and no output folder (real files and commands).

The ``.metadata`` case is the one that ran code before: the dtype probe read it through Megatron's
``load_tensors_metadata`` ahead of the screen. ``maspo train`` with such a checkpoint as
``model.megatron_checkpoint`` refuses it the same way, before building a model or writing anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_maspo.errors import InputError
from megatron_maspo.model.spec import tiny_qwen2_spec
from tests.hostile import plant_in_bytes_item, system_object, system_pickle


def _checkpoint(folder: Path) -> Path:
    """A torch_dist folder with a bytes item and a ``common.pt``, plus the architecture convert reads."""
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.randn(3, 4), "extra": [None]}, checkpoint_id=str(folder))
    torch.save({"steps_done": 1}, folder / "common.pt")
    (folder / "maspo_arch.json").write_text(json.dumps(dataclasses.asdict(tiny_qwen2_spec())))
    return folder


def test_a_hostile_metadata_is_refused_by_the_command_in_one_line(tmp_path):
    ckpt, marker, out = _checkpoint(tmp_path / "ckpt"), tmp_path / "ran", tmp_path / "hf"
    (ckpt / ".metadata").write_bytes(system_pickle(marker))
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "convert", "megatron-to-hf",
                        "--ckpt", str(ckpt), "--out", str(out)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr and len(lines) <= 3, r.stderr
    assert lines[-1] == (f"maspo convert: error: {ckpt / '.metadata'}: refused, its pickle names posix.system "
                         "(not a torch checkpoint metadata class); see docs/security.md"), lines
    assert not out.exists()


@pytest.mark.parametrize("where", ["bytes item", "common.pt"])
def test_a_hostile_shard_item_or_pt_is_refused_before_any_rank_starts(tmp_path, where):
    from megatron_maspo.conversion.jobs import convert_megatron_to_hf

    ckpt, marker, out = _checkpoint(tmp_path / "ckpt"), tmp_path / "ran", tmp_path / "hf"
    if where == "bytes item":
        bad, _ = plant_in_bytes_item(ckpt, marker)
    else:
        bad = ckpt / "common.pt"
        torch.save({"x": system_object(marker)}, bad)
    with pytest.raises(InputError, match=f"^{bad}: .*refused"):
        convert_megatron_to_hf(ckpt, out)
    assert not marker.exists() and not out.exists()


def test_a_hostile_initial_checkpoint_is_refused_by_train_before_any_model(tmp_path):
    ckpt, marker, run = _checkpoint(tmp_path / "ckpt"), tmp_path / "ran", tmp_path / "run"
    bad, key = plant_in_bytes_item(ckpt, marker)
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--set",
                        f"model.megatron_checkpoint={ckpt}", "--set", f"checkpoint.run_dir={run}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"maspo train: error: {bad}: bytes item {key!r}: refused, it is not plain tensor data"), lines
    assert not run.exists()  # refused before anything was written

