"""Supervised engines in a real disaggregated run (``rollout.supervise_engines``): 2 ranks under torchrun
(gloo), one trainer and one engine owner whose built-in engine runs in a process of its own.

- uninterrupted, every per-step metric equals the unsupervised run's (the fault figures aside);
- the engine SIGKILLed in the middle of a generation (``MASPO_ENGINE_FAULT``: the engine process signals
  itself at a chosen decode step): the run completes, every per-step reward, loss and other metric
  equals the uninterrupted run's, ``rollout/engine_restarts`` is 1, one failure line, no engine left;
  the same under the GPU-semantics emulation (``MASPO_EMULATE_GPU=1``, one emulated GPU per node);
- the engine stopped (SIGSTOP): detected within ``rollout.engine_timeout_s``, same metrics;
- no restart left: the job ends with one line naming the engine and the budget, no engine left;
- 2 trainers + 2 engines (4 ranks), engine 1 killed or stopped mid-generation: the uninterrupted run's
  metrics.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_disaggregated import K1, _cmd, _env, _same, _torchrun
from tests.e2e.test_staleness import LEARNING
from tests.e2e.test_train_cli import _metrics, _run_concurrently

pytestmark = pytest.mark.slow

SETS = [*LEARNING, *K1, "train.steps=5", "checkpoint.save_every=0"]
SUPERVISED = [*SETS, "rollout.supervise_engines=true"]
FAULT_KEYS = ("rollout/engine_restarts", "rollout/prompts_reissued", "rollout/engines_live",
              "rollout/engine_failures", "rollout/engine_time_lost_s", "rollout/engine_detect_s_max")


def _without_faults(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in FAULT_KEYS} for r in _same(rows)]


def _engine_processes() -> list[int]:
    """Pids of supervised engine processes on this machine (named by ``engine_process.process_name``)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("maspo-engine"):
                out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    sup, plain = _run_concurrently(_cmd(sets=[*SUPERVISED, f"checkpoint.run_dir={root / 'sup'}"]),
                                   _cmd(sets=[*SETS, f"checkpoint.run_dir={root / 'plain'}"]))
    assert sup.returncode == 0, sup.stderr[-3000:]
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not _engine_processes()
    return _metrics(root / "sup"), _metrics(root / "plain")


def test_a_supervised_run_equals_the_unsupervised_one(reference):
    sup, plain = reference
    assert len(sup) == len(plain) == 5
    assert len({r["reward/mean"] for r in sup}) > 1  # not a degenerate run: the equality below means something
    assert _without_faults(sup) == _same(plain)
    assert all(r["rollout/engine_restarts"] == 0 and r["rollout/engines_live"] == 1 for r in sup)


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "gpu_emulation"])
def test_an_engine_killed_mid_generation_changes_no_metric(reference, tmp_path, emulate):
    emulation = {"MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPUS_PER_NODE": "1"} if emulate else {}
    run = _torchrun(sets=[*SUPERVISED, f"checkpoint.run_dir={tmp_path}"],
                    env=_env(MASPO_ENGINE_FAULT="engine=0,kind=kill,call=3,step=2", **emulation))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert _without_faults(rows) == _without_faults(reference[0])  # rewards, losses, everything else
    assert rows[-1]["rollout/engine_restarts"] == 1
    assert rows[-1]["rollout/prompts_reissued"] == 4  # the engine's whole batch of 4 prompts, made again
    assert sum(r["rollout/engine_failures"] for r in rows) == 1
    assert sum(r["rollout/engine_time_lost_s"] for r in rows) > 0
    lines = [x for x in run.stderr.splitlines() if "failed: killed by SIGKILL" in x]
    assert len(lines) == 1 and "rollout engine 0 on host " in lines[0], run.stderr[-3000:]
    assert not _engine_processes()


def test_a_stopped_engine_is_detected_within_the_timeout(reference, tmp_path):
    timeout = 3.0
    run = _torchrun(sets=[*SUPERVISED, f"checkpoint.run_dir={tmp_path}", f"rollout.engine_timeout_s={timeout}"],
                    env=_env(MASPO_ENGINE_FAULT="engine=0,kind=stop,call=2,step=3"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert _without_faults(rows) == _without_faults(reference[0])
    assert rows[-1]["rollout/engine_restarts"] == 1
    detect = max(r["rollout/engine_detect_s_max"] for r in rows)
    assert timeout - 0.5 <= detect <= timeout + 1.5, detect
    assert sum("failed: hung: no progress for" in x for x in run.stderr.splitlines()) == 1
    assert not _engine_processes()  # the stopped process was killed


def test_no_restart_left_ends_the_job_with_one_line(tmp_path):
    run = _torchrun(sets=[*SUPERVISED, f"checkpoint.run_dir={tmp_path}", "rollout.max_engine_restarts=0"],
                    env=_env(MASPO_ENGINE_FAULT="engine=0,kind=kill,call=2,step=2"))
    assert run.returncode != 0
    hits = [x for x in run.stderr.splitlines() if "no restart left" in x]
    assert hits, run.stderr[-3000:]
    assert re.search(r"rollout engine 0 on host \S+ \(pid \d+, epoch 0\) failed: killed by SIGKILL; 4 prompts "
                     r"re-issued; no restart left: rollout\.max_engine_restarts=0 spent$", hits[0]), hits[0]
    assert not _engine_processes()


@pytest.mark.parametrize("kind, cause", [("kill", "killed by SIGKILL"), ("stop", "hung: no progress for")])
def test_two_trainers_and_two_engines_one_failing_mid_generation(tmp_path, kind, cause):
    """The issue's layout: 4 ranks (2 trainers, 2 engine owners), engine 1 SIGKILLed (or SIGSTOPped,
    detected within ``rollout.engine_timeout_s``) in its third generation; every per-step metric equals
    the uninterrupted run's."""
    sets = [*SUPERVISED, "train.steps=4", "rollout.engine_timeout_s=3"]
    env = _env(MASPO_ENGINE_FAULT=f"engine=1,kind={kind},call=3,step=2")
    clean = subprocess.Popen(_cmd(sets=[*sets, f"checkpoint.run_dir={tmp_path / 'clean'}"], nproc=4, engines=2),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    failed = subprocess.run(_cmd(sets=[*sets, f"checkpoint.run_dir={tmp_path / 'failed'}"], nproc=4, engines=2),
                            capture_output=True, text=True, timeout=600, env=env)
    _, clean_err = clean.communicate(timeout=600)
    assert clean.returncode == 0, clean_err[-3000:]
    assert failed.returncode == 0, failed.stderr[-3000:]
    a, b = _metrics(tmp_path / "clean"), _metrics(tmp_path / "failed")
    assert len(a) == len(b) == 4 and _without_faults(a) == _without_faults(b)
    assert b[-1]["rollout/engine_restarts"] == 1 and b[-1]["rollout/prompts_reissued"] == 2  # engine 1's shard
    assert b[-1]["rollout/engines_live"] == 2 and a[-1]["rollout/engine_restarts"] == 0
    if kind == "stop":
        assert 2.5 <= max(r["rollout/engine_detect_s_max"] for r in b) <= 4.5
    assert sum("rollout engine 1 on host " in x and cause in x for x in failed.stderr.splitlines()) == 1
    assert not _engine_processes()
