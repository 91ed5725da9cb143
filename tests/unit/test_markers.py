"""Extras are matched by marker, not by keyword: a test in a folder named ``launch`` without the
``launch`` marker runs when nemo-run is absent; a marked one is skipped with the extra named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_TESTS = '''
import pytest


def test_pure_arithmetic():
    assert 6 * 7 == 42


@pytest.mark.launch
def test_needs_nemo_run():
    import nemo_run  # noqa: F401
'''


def test_launch_folder_without_the_extra_runs_unmarked_tests(tmp_path):
    folder = tmp_path / "launch"  # the directory name that used to skip every test inside it
    folder.mkdir()
    (folder / "test_planner_like.py").write_text(_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", str(folder), "-q", "-rs", "-p", "no:cacheprovider",
                        "-p", "tests.conftest", "-p", "tests._hide_nemo_run", "--rootdir", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "1 passed, 1 skipped" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "needs the 'launch' extra" in r.stdout
