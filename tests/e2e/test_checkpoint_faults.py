"""``maspo train --resume`` / ``maspo eval`` on crafted, damaged and unwritable checkpoints (real runs).

One micro run writes ``step_1`` and ``step_2``; each test works on a copy of it:

- each pickle of the checkpoint (``common.pt``, an old-style ``rng/rank0.pt``, ``.metadata``) replaced by
  one that runs code: exit 2, one line naming the file, and the code did not run; the untouched copy resumes;
- the same in a bytes item (``_extra_state``) inside a ``*.distcp`` shard, with the manifest resealed to
  match, and a hostile ``.metadata``: ``--resume`` and ``maspo eval`` both refuse it in one line;
- a truncated file in the newest checkpoint: resume names it and continues from ``step_1``; nothing
  complete left: exit 2, one line;
- ``--resume`` with another model size or loss method: exit 2, one line naming the field;
- the disk filling during a save (a file-size limit): one line naming the path; ``step_2`` still intact.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_maspo.model.ckpt_manifest import damage
from tests.e2e.test_train_cli import MICRO

pytestmark = pytest.mark.slow  # a micro run plus one resume per case: ~25 s each on 2 shared cores


def _maspo(*args: str, limit_fsize: int | None = None) -> subprocess.CompletedProcess:
    def preexec() -> None:  # only in the child: writes past the limit fail with EFBIG (Python ignores SIGXFSZ)
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", *args], capture_output=True,
                          text=True, timeout=300, env=env, preexec_fn=preexec)


def _resume(run: Path, steps: int = 3, **kw) -> subprocess.CompletedProcess:
    return _maspo("train", "--resume", str(run), "--set", f"train.steps={steps}", **kw)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pristine") / "run"
    cmd = ["train"]
    for s in [*MICRO, "train.steps=2", "checkpoint.save_every=1", f"checkpoint.run_dir={run}"]:
        cmd += ["--set", s]
    r = _maspo(*cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _copy(pristine: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    return run


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["common.pt", "rng/rank0.pt", ".metadata"])
def test_a_code_running_pickle_is_refused_and_does_not_run(pristine, tmp_path, name):
    import pickle

    run = _copy(pristine, tmp_path)
    step = run / "checkpoints" / "step_2"
    marker = tmp_path / "code_ran"
    if name == "rng/rank0.pt":  # an old-style checkpoint: its RNG state as a torch pickle
        (step / "rng" / "rank0.safetensors").unlink()
        torch.save({"cpu": _Evil(marker)}, step / name)
    elif name == ".metadata":
        (step / name).write_bytes(pickle.dumps(_Evil(marker)))
    else:
        torch.save({"x": _Evil(marker)}, step / name)
    (step / "manifest.json").unlink()  # as a crafted download would come: no manifest to give it away
    r = _resume(run)
    assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
    line = _last_line(r)
    assert line.startswith(f"maspo train: error: {step / name}: refused"), line
    if name == "common.pt":  # maspo eval loads the same way
        r = _maspo("eval", str(run), "--k", "1", "--num-problems", "2")
        assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
        assert _last_line(r).startswith(f"maspo eval: error: {step / name}: refused"), _last_line(r)


@pytest.mark.parametrize("where", ["bytes item", ".metadata"])
def test_a_hostile_shard_item_or_metadata_resealed_is_refused_by_resume_and_eval(pristine, tmp_path, where):
    from megatron_maspo.model.ckpt_manifest import write_manifest
    from tests.hostile import plant_in_bytes_item, system_pickle

    run = _copy(pristine, tmp_path)
    step = run / "checkpoints" / "step_2"
    marker = tmp_path / "code_ran"
    if where == "bytes item":
        bad, key = plant_in_bytes_item(step, marker)
        want = f"{bad}: bytes item {key!r}: refused"
    else:
        bad = step / ".metadata"
        bad.write_bytes(system_pickle(marker))
        want = f"{bad}: refused, its pickle names posix.system"
    write_manifest(step)  # whoever hands over a checkpoint can reseal its manifest
    for cmd, r in (("train", _resume(run)), ("eval", _maspo("eval", str(run), "--k", "1", "--num-problems", "2"))):
        assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert _last_line(r).startswith(f"maspo {cmd}: error: {want}"), _last_line(r)


@pytest.mark.parametrize(("change", "named"), [("model.tiny_hidden_size=64", "model.tiny_hidden_size 32 -> 64"),
                                               ("loss.method=grpo", "loss.method 'maspo' -> 'grpo'")])
def test_resume_with_another_model_or_method_is_one_line(pristine, tmp_path, change, named):
    run = _copy(pristine, tmp_path)
    r = _maspo("train", "--resume", str(run), "--set", "train.steps=3", "--set", change)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"maspo train: error: --resume {run}: its checkpoints cannot be loaded with this config: {named}; "
        "these cannot change on resume: start a new checkpoint.run_dir (to keep the weights, with "
        "model.megatron_checkpoint=<checkpoint> when the shapes match)"], r.stderr[-3000:]


def test_an_untouched_copy_resumes(pristine, tmp_path):
    run = _copy(pristine, tmp_path)
    r = _resume(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_2'} at step 2" in r.stderr


def test_a_truncated_newest_checkpoint_falls_back_and_none_left_is_one_line(pristine, tmp_path):
    run = _copy(pristine, tmp_path)
    bad = run / "checkpoints" / "step_2" / "__0_1.distcp"
    size = bad.stat().st_size
    os.truncate(bad, 100)
    r = _resume(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint step_2 is damaged: {bad} has 100 bytes, {size} were written" in r.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in r.stderr
    for step in ("step_2", "step_3"):  # keep_last=2: step_1 was pruned by the resumed run
        (run / "checkpoints" / step / ".metadata").unlink()
    r = _resume(run, steps=4)
    assert r.returncode == 2, r.stderr[-3000:]
    assert _last_line(r).startswith("maspo train: error: no complete checkpoint under"), _last_line(r)


def test_the_disk_filling_during_a_save_is_one_line_and_keeps_the_previous(pristine, tmp_path):
    run = _copy(pristine, tmp_path)
    shard = max((run / "checkpoints" / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    r = _resume(run, limit_fsize=shard.stat().st_size // 2)  # the next save's shards cannot be written
    assert r.returncode == 2, r.stderr[-3000:]
    line = _last_line(r)
    assert line.startswith(f"maspo train: error: writing checkpoint {run / 'checkpoints' / 'step_3'} "
                           "failed: no room") and line.endswith(
        f"the previous checkpoint {run / 'checkpoints' / 'step_2'} is intact"), line
    assert damage(run / "checkpoints" / "step_2") is None
    assert not (run / "checkpoints" / "step_3").exists()
