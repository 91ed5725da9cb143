"""The files in ``examples/`` work as their docstrings say: a custom grader in the crash-proof pool, a
custom dataset function equal to its jsonl export, a real `maspo train` with both hooks from a folder that
is not on ``sys.path``, and the launch scripts' real NeMo-Run dry runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_maspo.data.config import DataConfig
from megatron_maspo.data.dataset import load_examples
from megatron_maspo.reward.base import GradeStatus
from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from tests.e2e.test_train_cli import MICRO

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _env(**extra: str) -> dict[str, str]:
    # the repository on PYTHONPATH (a source checkout), the venv's bin (the `maspo` script) on PATH
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": path, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1", **extra}


def test_custom_grader_replaces_math_verify_in_the_pool(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    # spawn: a fresh interpreter per worker sees this sys.path (a forkserver may predate it in pytest)
    cfg = RewardConfig(grader="custom_reward:last_number_matches", num_workers=1, start_method="spawn")
    with MathReward(cfg) as reward:
        out = reward(["the sum is 7", "\\boxed{7}", "8 is my guess", "no idea"], ["7", "7", "7", "7"])
    # "the sum is 7" has no \boxed{} nor Answer: line: math-verify would score it wrong
    assert out.statuses == [GradeStatus.CORRECT, GradeStatus.CORRECT, GradeStatus.WRONG, GradeStatus.WRONG]
    assert out.rewards == [1.0, 1.0, -1.0, -1.0]


def test_custom_dataset_function_equals_its_jsonl_export(monkeypatch, tmp_path):
    out = tmp_path / "my_problems.jsonl"
    r = subprocess.run([sys.executable, str(EXAMPLES / "custom_dataset.py"), str(out)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from_fn = load_examples(DataConfig(source="custom_dataset:subtraction_rows", num_examples=200, seed=0))
    from_file = load_examples(DataConfig(source=str(out)))
    assert len(from_fn) == 200
    assert [(e.prompt, e.answer) for e in from_fn] == [(e.prompt, e.answer) for e in from_file]
    assert all(int(e.prompt[0]) - int(e.prompt[2]) == int(e.answer) for e in from_fn)


def test_train_with_both_hooks_from_the_examples_folder(tmp_path):
    run_dir = tmp_path / "run"
    sets = [*MICRO, "train.steps=1", f"checkpoint.run_dir={run_dir}",
            "reward.grader=custom_reward:last_number_matches", "data.source=custom_dataset:subtraction_rows"]
    cmd = [sys.executable, "-m", "megatron_maspo.cli.main", "train"]
    for s in sets:
        cmd += ["--set", s]
    # The folder is named on PYTHONPATH, as the examples' docstrings say (`PYTHONPATH=. maspo train ...`).
    env = _env()
    env["PYTHONPATH"] = f"{EXAMPLES}{os.pathsep}{env['PYTHONPATH']}"
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 1 and all("reward/mean" in row for row in rows)


def test_hook_typo_fails_before_any_work(tmp_path):
    env = _env()
    env["PYTHONPATH"] = f"{EXAMPLES}{os.pathsep}{env['PYTHONPATH']}"
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--set",
                        "reward.grader=custom_reward:no_such_fn", "--set", f"checkpoint.run_dir={tmp_path / 'r'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "has no callable 'no_such_fn'" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "r").exists()


def test_a_hook_in_the_working_directory_is_not_imported_implicitly(tmp_path):
    # `python -m` puts the working directory first on sys.path; the hook is still not imported from it.
    marker = tmp_path / "imported"
    (tmp_path / "stray.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef f(r, a):\n    return True\n")
    r = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--set",
                        "reward.grader=stray:f", "--set", f"checkpoint.run_dir={tmp_path / 'r'}"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and not marker.exists(), r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "reward.grader='stray:f'" in line and "working directory, which is not searched" in line, line


@pytest.mark.launch
def test_launch_slurm_script_dry_run(tmp_path):
    env = _env(ACCOUNT="acct", PARTITION="batch", JOB_DIR=str(tmp_path / "jobs"),
               NEMORUN_HOME=str(tmp_path / "home"))
    r = subprocess.run(["bash", str(EXAMPLES / "launch_slurm.sh"), "--dry-run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    for needle in ("#SBATCH --nodes=4", "#SBATCH --account=acct", "#SBATCH --partition=batch",
                   "/lustre/models:/models", "--nproc-per-node 8", "world_size: 32"):
        assert needle in r.stdout, needle


@pytest.mark.launch
def test_launch_local_script_dry_run(tmp_path):
    env = _env(JOB_DIR=str(tmp_path / "jobs"), NEMORUN_HOME=str(tmp_path / "home"), GPUS="2")
    r = subprocess.run(["bash", str(EXAMPLES / "launch_local.sh"), "--set", "train.steps=1", "--dry-run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    config = tmp_path / "jobs" / "tiny" / "config.yaml"
    assert config.is_file() and "world_size: 2" in r.stdout and "steps: 1" in r.stdout
    assert "'torchrun'" in r.stdout or "torchrun" in r.stdout
    assert "megatron_maspo.cli.main" in r.stdout and str(config) in r.stdout
