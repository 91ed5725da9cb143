"""Files under ``scripts/`` loaded as modules (scripts are not a package), one fixture per script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def study():
    """``scripts/offpolicy_study.py``."""
    return _load("offpolicy_study")


@pytest.fixture(scope="module")
def report():
    """``scripts/smollm2_report.py``."""
    return _load("smollm2_report")


@pytest.fixture(scope="module")
def compare():
    """``scripts/compare_losses.py``."""
    return _load("compare_losses")
