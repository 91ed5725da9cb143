"""``scripts/gpu_smoke.sh`` pieces that run without a GPU: shell syntax, the dry run's plan, and the Python
parts on CPU (gloo). The whole ``--cpu`` rehearsal is ``slow``. None of this proves the GPU path: the
script has to run on a GPU for that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SH = REPO / "scripts" / "gpu_smoke.sh"
PY = REPO / "scripts" / "gpu_smoke.py"
PARTS = ["install", "nccl", "train", "convert_h2m", "convert_m2h", "logprobs", "varlen"]


def _env() -> dict:
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}


def _py(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PY), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO)


def test_shell_syntax_and_dry_run_plan():
    assert subprocess.run(["bash", "-n", str(SH)]).returncode == 0
    out = subprocess.run(["bash", str(SH), "--dry-run"], capture_output=True, text=True, env=_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    planned = [line.split("]")[0].lstrip("[") for line in out.stdout.splitlines() if line.startswith("[")]
    assert planned == PARTS
    assert "model.bf16=true" in out.stdout and "--verify" in out.stdout
    table = out.stdout.split("summary")[1]
    assert all(p in table for p in PARTS)
    assert subprocess.run(["bash", str(SH), "--bogus"], capture_output=True, env=_env()).returncode == 2


def test_nccl_part_on_cpu_uses_gloo():
    out = _py("nccl", "--cpu")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SMOKE nccl: backend=gloo all_reduce=ok" in out.stdout


def test_logprobs_part_on_cpu_matches_naive():
    out = _py("logprobs", "--cpu", "--reps", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("SMOKE logprobs"))
    assert "logits: max_rel_err=" in line and "hidden: max_rel_err=" in line


def _metrics(run: Path, recs: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_check_train_passes_a_complete_run_and_fails_on_gaps(tmp_path):
    phases = ["generate", "grade", "old_logprobs", "train", "sync"]
    rec = {"step": 0, "actor/loss": 0.1, "time/step": 1.0, "reward/mean": 0.5, "memory/offloaded_gb": 0.1,
           **{f"memory/{p}_{k}_gb": 0.3 for p in phases for k in ("peak_rss", "rss")}}
    _metrics(tmp_path / "ok", [rec, {**rec, "step": 1}])
    out = _py("check-train", str(tmp_path / "ok"), "--steps", "2", "--cpu")
    assert out.returncode == 0 and "SMOKE train: steps=2" in out.stdout, out.stdout + out.stderr
    # the GPU mode also wants the allocator's peaks, a NaN loss fails, a missing step fails
    assert _py("check-train", str(tmp_path / "ok"), "--steps", "2").returncode == 1
    _metrics(tmp_path / "nan", [rec, {**rec, "step": 1, "actor/loss": float("nan")}])
    bad = _py("check-train", str(tmp_path / "nan"), "--steps", "2", "--cpu")
    assert bad.returncode == 1 and "PROBLEMS" in bad.stdout
    assert _py("check-train", str(tmp_path / "ok"), "--steps", "3", "--cpu").returncode == 1


@pytest.mark.slow
def test_cpu_rehearsal_of_the_whole_script(tmp_path):
    env = {**_env(), "SMOKE_DIR": str(tmp_path / "smoke")}
    out = subprocess.run(["bash", str(SH), "--cpu"], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for part in PARTS:
        assert any(line.startswith(part) and " PASS " in line for line in out.stdout.splitlines()), part


def test_varlen_part_skips_on_cpu():
    out = _py("varlen", "--cpu")
    assert out.returncode == 0 and "SMOKE varlen: skipped with --cpu" in out.stdout
