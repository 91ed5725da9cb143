"""The rollout pool's ``/dev/shm`` staging (``rollout/shm_budget.py``): two syncs per engine owner, this
machine's free size read with ``os.statvfs``, and ``maspo doctor`` failing a recipe whose busiest node would
not fit, with the fix named."""

from __future__ import annotations

import os

from megatron_maspo.rollout import shm_budget
from megatron_maspo.rollout.shm_budget import shm_fix, shm_free_bytes, shm_verdict, staging_bytes

GIB = 2**30
DISAGG_7B = ["r1_distill_qwen_7b_maspo", "--nodes", "4", "--set", "rollout.placement=disaggregated", "--set",
             "rollout.engine_ranks=16", "--set", "rollout.max_staleness=1", "--set", "loss.tis_cap=2.0"]


def test_two_syncs_per_owner_and_the_fix_rounds_up_with_headroom():
    assert staging_bytes(3 * GIB, 8) == 48 * GIB
    fix = shm_fix(48 * GIB)
    assert "--ipc=host" in fix and "--shm-size=53g" in fix and "weight_transport=bytes" in fix


def test_free_bytes_come_from_statvfs(tmp_path):
    st = os.statvfs(tmp_path)
    assert shm_free_bytes(str(tmp_path)) == st.f_bavail * st.f_frsize
    assert shm_free_bytes(str(tmp_path / "absent")) is None


def test_verdict_names_the_fix_only_when_short():
    ok, line = shm_verdict(2 * GIB, 3 * GIB)
    assert ok and line == "3.0 GiB free in /dev/shm, the staging needs 2.0 GiB"
    ok, line = shm_verdict(2 * GIB, GIB // 16)
    assert not ok and "--shm-size=3g" in line
    ok, line = shm_verdict(2 * GIB, None)
    assert not ok and "no /dev/shm" in line


def _doctor(argv, monkeypatch, capsys, free):
    from megatron_maspo.cli.main import main

    monkeypatch.setattr(shm_budget, "shm_free_bytes", lambda path=shm_budget.SHM_PATH: free)  # this node's size
    rc = main(["doctor", "--no-te", *argv])
    return rc, capsys.readouterr().out


def test_doctor_fails_a_recipe_whose_staging_does_not_fit(monkeypatch, capsys):
    vllm = ["--set", "rollout.engine=vllm"]  # the recipe's own engine, said here for the reader
    rc, out = _doctor([*DISAGG_7B, *vllm], monkeypatch, capsys, free=64 * 2**20)  # Docker's default
    assert rc == 1 and "shared memory        0.1 GiB free in /dev/shm" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("BROKEN   rollout-pool staging"))
    assert "8 vLLM engine owner(s) x 2 syncs x 14.2 GiB bfloat16" in line and "--shm-size=250g" in line
    rc, out = _doctor([*DISAGG_7B, *vllm], monkeypatch, capsys, free=300 * GIB)  # --ipc=host on a big node
    assert "NOTE     rollout-pool staging" in out and "BROKEN   rollout" not in out
    builtin = ["--set", "rollout.engine=builtin"]  # nothing staged in shared memory
    rc, out = _doctor([*DISAGG_7B, *builtin], monkeypatch, capsys, free=64 * 2**20)
    assert "stage no weight sync in /dev/shm" in out and "BROKEN   rollout" not in out
