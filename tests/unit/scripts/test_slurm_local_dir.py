"""``scripts/slurm_local.sh`` keeps root's slurm.conf in a folder only root can write: the default is under
/run, and ``up`` refuses a state folder another user could have planted (run as the real script)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "slurm_local.sh"


def _script(*args: str, state: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_LOCAL_DIR"}
    if state is not None:
        env["SLURM_LOCAL_DIR"] = str(state)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30)


def test_the_default_state_folder_is_not_a_fixed_tmp_path():
    assert _script("env").stdout.strip() == "export SLURM_CONF=/run/maspo-slurm/slurm.conf"


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership checks are root's (the script runs as root)")
@pytest.mark.parametrize("plant", ["world-writable", "symlink", "other owner"])
def test_up_refuses_a_state_folder_someone_else_could_write(tmp_path, plant):
    state = tmp_path / "state"
    if plant == "symlink":
        (tmp_path / "elsewhere").mkdir()
        state.symlink_to(tmp_path / "elsewhere")
        want = "is a symbolic link"
    else:
        state.mkdir()
        if plant == "world-writable":
            state.chmod(0o777)
            want = "writable by group or others (mode 777)"
        else:
            os.chown(state, 1234, 1234)
            want = "belongs to uid 1234, not root"
    r = _script("up", state=state)
    assert r.returncode == 1 and want in r.stderr, r.stderr
    assert not (state / "slurm.conf").exists() and not (tmp_path / "elsewhere" / "slurm.conf").exists()
