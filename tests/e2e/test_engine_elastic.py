"""Elastic capacity in a real disaggregated run (``maspo engines``): 2 ranks under torchrun (gloo), one
trainer and one engine owner with supervised built-in engines, 5 on-policy steps, each owner's share cut
into 2 chunks (``rollout.supervised_chunks``) so that the engine count changes no batch.

``maspo engines add RUN --from-step 3`` and ``maspo engines drain RUN --engine 0 --from-step 5``, written
into the run directory before the job starts (its steps take a tenth of a second here, less than the
command's own start, so a request made while it runs could land at any later boundary; the owner reads
the directory at every boundary either way): the new engine is started after step 2's update and makes a
share of steps 3 and 4, engine 0 makes nothing of step 5, and every per-step reward, loss and other
metric equals the run whose pool never changed. The same under the GPU-semantics emulation (one
emulated GPU per node).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_disaggregated import _cmd, _env, _same
from tests.e2e.test_engine_faults import _engine_processes
from tests.e2e.test_staleness import LEARNING
from tests.e2e.test_train_cli import _metrics

pytestmark = pytest.mark.slow

SETS = [*LEARNING, "train.steps=5", "checkpoint.save_every=0", "rollout.supervise_engines=true",
        "rollout.supervised_chunks=2"]


def _engines_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "engines", *args], capture_output=True,
                         text=True, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("emulate", [False, True], ids=["plain", "gpu_emulation"])
def test_an_engine_added_while_the_job_runs_serves_from_step_3(tmp_path, emulate):
    emulation = {"MASPO_EMULATE_GPU": "1", "MASPO_EMULATE_GPUS_PER_NODE": "1"} if emulate else {}
    fixed, grown = tmp_path / "fixed", tmp_path / "grown"
    env = _env(**emulation)
    # the run's resolved config, as the job will write it: what `maspo engines` reads to know the pool
    single = _cmd(sets=[*SETS, f"checkpoint.run_dir={grown}", "parallel.world_size=2"])[6:]  # no torchrun
    cfg = subprocess.run([sys.executable, *single, "--print-config"], capture_output=True, text=True, timeout=120, env=env)
    assert cfg.returncode == 0, cfg.stderr[-2000:]
    grown.mkdir()
    (grown / "config.yaml").write_text(cfg.stdout)
    _engines_cli("add", str(grown), "--from-step", "3")
    _engines_cli("drain", str(grown), "--engine", "0", "--from-step", "5")
    ref = subprocess.Popen(_cmd(sets=[*SETS, f"checkpoint.run_dir={fixed}"]), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    run = subprocess.Popen(_cmd(sets=[*SETS, f"checkpoint.run_dir={grown}"]), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    _, err = run.communicate(timeout=600)
    _, ref_err = ref.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    assert ref.returncode == 0, ref_err[-3000:]

    rows, want = _metrics(grown), _metrics(fixed)
    assert len(rows) == len(want) == 5
    assert _same(rows) == _same(want)  # rewards, losses, everything but the engines' own figures
    share = [(r.get("rollout/engine_prompts/e0", 0.0), r.get("rollout/engine_prompts/e1", 0.0)) for r in rows]
    assert share[0][1] == share[1][1] == 0 and share[0][0] == share[1][0] > 0  # steps 1-2: engine 0 alone
    assert share[2][1] > 0 and share[3][1] > 0  # the joined engine serves from step 3 on
    assert share[4] == (0.0, sum(share[0]))  # step 5: engine 0 drained, engine 1 makes it all
    assert [r["rollout/engines_live"] for r in rows] == [1, 1, 2, 2, 1]
    assert rows[-1]["rollout/engines_joined"] == 1 and rows[-1]["rollout/engines_drained"] == 1
    assert rows[-1]["rollout/engine_restarts"] == 0
    assert sum("rollout engine 1 joined owner 0's fleet before step 3" in x for x in err.splitlines()) == 1
    listing = _engines_cli("list", str(grown))
    assert "add engine 1 (owner 0, from step 3): applied before step 3" in listing
    assert "drain engine 0 (owner 0, from step 5): applied before step 5" in listing
    assert not _engine_processes()
