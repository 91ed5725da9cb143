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
PARTS_PY = REPO / "scripts" / "gpu_smoke_parts.py"
PARTS = ["install", "nccl", "train", "convert_h2m", "convert_m2h", "logprobs", "lp_bf16", "ipc", "sleep",
         "mismatch", "varlen", "disagg"]
WINDOW_S = 480  # the lent machine: 15 minutes for its start, one run and a rerun of its failed parts


def _env() -> dict:
    # no wheels folder: what runs does not depend on whether someone ran --fetch-wheels in this checkout
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
            "SMOKE_WHEELS": str(REPO / "scripts" / "no-wheels")}


def _py(*args: str, timeout: int = 300, script: Path = PY) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=REPO)


def _sh(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SH), *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)


def test_list_prints_every_part_with_timeouts_that_fit_the_window():
    out = _sh("--list")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    parts = {name: int(secs) for name, secs in rows if name != "total"}
    assert list(parts) == PARTS
    assert sum(parts.values()) <= WINDOW_S and ["total", str(sum(parts.values()))] in rows


def test_only_runs_the_named_parts_and_rejects_unknown_ones():
    out = _sh("--dry-run", "--only", "ipc,sleep")
    planned = [line.split("]")[0].lstrip("[") for line in out.stdout.splitlines() if line.startswith("[")]
    assert out.returncode == 0 and planned == ["ipc", "sleep"], out.stdout + out.stderr
    # the dry run shows each part's enforced limit (here the GPU one: x1)
    assert "[ipc] (timeout 35s)" in out.stdout
    both = _sh("--dry-run", "--only", "disagg")  # both processes on GPU 0, two pools, built-in engine
    # two one-process torchrun agents: each process is LOCAL_RANK 0 of a one-GPU "node"
    assert "CUDA_VISIBLE_DEVICES=0" in both.stdout and both.stdout.count("--nnodes 2 --nproc-per-node 1") == 2
    assert "rollout.placement=disaggregated" in both.stdout and "rollout.engine_ranks=1" in both.stdout
    bad = _sh("--dry-run", "--only", "ipc,nope")
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr


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


def test_bench_runs_install_and_the_benchmarks_only_and_the_smoke_never_runs_them():
    bench = _sh("--dry-run", "--bench")
    planned = [line.split("]")[0].lstrip("[") for line in bench.stdout.splitlines() if line.startswith("[")]
    assert bench.returncode == 0 and planned == ["install", "bench_kernels", "bench_transport"], bench.stdout
    assert "bench_logprob_kernels.py" in bench.stdout and "bench_weight_transport.py" in bench.stdout
    rows = [line.split() for line in _sh("--list", "--bench").stdout.splitlines()]
    assert sum(int(s) for n, s in rows if n != "total") <= WINDOW_S
    one = _sh("--dry-run", "--only", "bench_transport")
    assert one.returncode == 0 and "[bench_transport]" in one.stdout and "[ipc]" not in one.stdout


@pytest.mark.slow  # ~40 s: the interpreter runs the kernels, a spawned engine loads 0.36 GiB four times
def test_bench_rehearsal_checks_then_prints_both_tables(tmp_path):
    out = subprocess.run(["bash", str(SH), "--cpu", "--bench"], capture_output=True, text=True,
                         env={**_env(), "SMOKE_DIR": str(tmp_path / "bench")}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    kernels = (tmp_path / "bench" / "bench_kernels.log").read_text()
    assert "triton: max error" in kernels and "forward+backward" in kernels
    transport = (tmp_path / "bench" / "bench_transport.log").read_text()
    assert "every tensor's digest in the engine equals the sender's" in transport
    for phase in ("pack", "hand-over", "load", "transfer", "direct", "verify", "d2d copy"):
        assert any(line.startswith(phase) for line in transport.splitlines()), phase


@pytest.mark.slow  # ~30 s on 2 cores: a spawned engine process imports torch and transformers
def test_only_ipc_passes_alone_on_cpu(tmp_path):
    out = subprocess.run(["bash", str(SH), "--cpu", "--only", "ipc"], capture_output=True, text=True,
                         env={**_env(), "SMOKE_DIR": str(tmp_path / "smoke")}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("ipc "))
    assert " PASS " in row and "shared-memory" in row and "bitwise ok" in row


@pytest.mark.slow  # ~20 s
def test_sleep_part_on_cpu_round_trips_engine_and_trainer_state():
    out = _py("sleep", "--cpu", script=PARTS_PY)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "bit-exact=yes" in out.stdout and "offloaded 0 MiB" not in out.stdout


def test_lp_bf16_part_on_cpu_within_tolerance():
    out = _py("lp_bf16", "--cpu", script=PARTS_PY)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "ABOVE" not in out.stdout and "hidden: logp=" in out.stdout


def test_varlen_part_reports_not_available_or_runs_the_named_backend():
    out = _py("varlen", "--cpu", script=PARTS_PY)
    assert out.returncode == 0 and "SMOKE varlen:" in out.stdout, out.stderr[-2000:]
    bogus = subprocess.run([sys.executable, str(PARTS_PY), "varlen", "--cpu"], capture_output=True, text=True,
                           timeout=120, env={**_env(), "SMOKE_VARLEN_BACKEND": "no_such_backend"}, cwd=REPO)
    assert bogus.returncode == 0 and "not available" in bogus.stdout


def test_check_verify_holds_the_conversion_figure_to_its_tolerance(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", PY)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)  # in-process: three subprocesses importing torch cost ~20 s here
    log = tmp_path / "h2m.out"
    log.write_text("[maspo] INFO ...\nverify: max relative logits error 3.000e-07\n")
    assert smoke.main(["check-verify", str(log), "--tol", "1e-4"]) == 0
    assert smoke.main(["check-verify", str(log), "--tol", "1e-8"]) == 1
    assert "ABOVE TOLERANCE" in capsys.readouterr().out
    log.write_text("no figure\n")
    assert smoke.main(["check-verify", str(log), "--tol", "1e-4"]) == 1


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


def test_check_train_pools_wants_finite_figures_and_a_sync_every_step(tmp_path):
    """A disaggregated run's metrics (the training pool's): no generate/grade memory there, a zero gradient
    allowed (the part checks that the job finishes), a sync that moved bytes required."""
    rec = {"step": 0, "actor/loss": 0.0, "actor/grad_norm": 0.0, "time/step": 1.0, "reward/mean": -2.0,
           "sync/gb_per_s": 0.05, **{f"memory/{p}_{k}_gb": 0.3 for p in ("old_logprobs", "train", "sync")
                                     for k in ("peak_rss", "rss")}}
    _metrics(tmp_path / "ok", [rec, {**rec, "step": 1, "actor/grad_norm": 1.2}])
    out = _py("check-train", str(tmp_path / "ok"), "--steps", "2", "--pools", "--cpu")
    assert out.returncode == 0 and "SMOKE disagg: steps=2" in out.stdout, out.stdout + out.stderr
    assert _py("check-train", str(tmp_path / "ok"), "--steps", "2", "--cpu").returncode == 1  # colocated rules
    _metrics(tmp_path / "nosync", [rec, {**rec, "step": 1, "sync/gb_per_s": 0.0}])
    bad = _py("check-train", str(tmp_path / "nosync"), "--steps", "2", "--pools", "--cpu")
    assert bad.returncode == 1 and "sync/gb_per_s=0.0" in bad.stdout
    _metrics(tmp_path / "nan", [rec, {**rec, "step": 1, "actor/grad_norm": float("nan")}])
    assert _py("check-train", str(tmp_path / "nan"), "--steps", "2", "--pools", "--cpu").returncode == 1


def _script_array(name: str) -> list[str]:
    """A bash array of gpu_smoke.sh, e.g. ``CARRIED=(a b\n c)``."""
    text = SH.read_text()
    body = text[text.index(f"\n{name}=(") + len(name) + 3:]
    return body[:body.index(")")].split()


def test_every_requirement_of_the_project_and_the_carried_wheels_is_carried_or_on_the_target():
    """Re-read from the installed metadata: what the project and each carried wheel require (no extras) is
    carried, on the target's list, or required by something on that list (e.g. packaging by transformers)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as canon

    def needs(dist: str) -> set[str]:
        reqs = [Requirement(r) for r in md.distribution(dist).requires or []]
        return {canon(r.name) for r in reqs
                if r.marker is None or r.marker.evaluate({"extra": "", "python_version": "3.12"})}

    carried = {canon(c.split("==")[0]) for c in _script_array("CARRIED")}
    target = {canon(t) for t in _script_array("TARGET_HAS")}
    assert {"megatron-core", "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime"} <= carried
    closure, todo = set(target), list(target)
    while todo:  # what the target's own packages pulled in is there too
        for n in needs(todo.pop()) - closure:
            closure.add(n)
            todo.append(n)
    missing = {d: needs(d) - carried - closure for d in ["megatron-maspo", *sorted(carried)]}
    assert not any(missing.values()), missing
    # megatron-core declares packaging>=24.2, more than transformers asks of the image: carried
    assert "packaging" in needs("megatron-core") and "packaging" in carried


def test_install_skips_a_wheel_for_another_python_in_the_rehearsal_only(tmp_path):
    """The cp312 megatron-core on this machine's Python: the --cpu rehearsal names it and uses this
    environment (``--cpu --only ipc`` used to fail here); on the target the part fails."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "faraway-1.0-cp399-cp399-manylinux_2_28_x86_64.whl").write_bytes(b"never opened")
    env = {**_env(), "SMOKE_WHEELS": str(wheels), "SMOKE_DIR": str(tmp_path / "gpu")}
    gpu = subprocess.run(["bash", str(SH), "--only", "install"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert gpu.returncode == 1 and "the target must install every wheel" in gpu.stderr, gpu.stdout + gpu.stderr
    env["SMOKE_DIR"] = str(tmp_path / "cpu")
    cpu = subprocess.run(["bash", str(SH), "--cpu", "--only", "install"], capture_output=True, text=True,
                         env=env, timeout=120)
    row = next(line for line in cpu.stdout.splitlines() if line.startswith("install "))
    assert cpu.returncode == 0 and " PASS " in row, cpu.stdout + cpu.stderr
    assert "skipped (not for this Python): faraway-1.0; project from checkout" in row


def test_check_train_passes_a_complete_run_and_fails_on_gaps(tmp_path):
    phases = ["generate", "grade", "old_logprobs", "train", "sync"]
    rec = {"step": 0, "actor/loss": 0.1, "actor/grad_norm": 0.2, "time/step": 1.0, "reward/mean": 0.5, "memory/offloaded_gb": 0.1,
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
    # zero advantages give a zero gradient: that run trained nothing, so the part fails
    _metrics(tmp_path / "flat", [rec, {**rec, "step": 1, "actor/grad_norm": 0.0}])
    flat = _py("check-train", str(tmp_path / "flat"), "--steps", "2", "--cpu")
    assert flat.returncode == 1 and "actor/grad_norm=0.0" in flat.stdout


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
