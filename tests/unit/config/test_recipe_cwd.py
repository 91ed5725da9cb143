"""``--recipe foo`` never runs a ``./foo.py`` of the working directory (``python -m`` and torchrun put the
working directory first on sys.path); ``--recipe ./foo.py`` runs it, as asked (real CLI processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

_RECIPE = """\
from pathlib import Path
Path("recipe_ran").write_text("x")
from megatron_maspo.recipes.tiny import config
"""


def _print_config(cwd: Path, recipe: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "train", "--recipe", recipe,
                           "--print-config"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_module_name_does_not_import_a_file_of_the_working_directory(tmp_path):
    (tmp_path / "foo.py").write_text(_RECIPE)
    r = _print_config(tmp_path, "foo")
    assert r.returncode == 2 and not (tmp_path / "recipe_ran").exists(), r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maspo train: error: unknown recipe 'foo'"), lines
    assert lines[0].endswith("foo.py in the working directory is not searched: pass --recipe ./foo.py to run it")
    r = _print_config(tmp_path, "./foo.py")  # named as a file: the user chose to run it
    assert r.returncode == 0 and (tmp_path / "recipe_ran").exists(), r.stderr[-2000:]
