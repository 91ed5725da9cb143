"""Shared pytest set-up: marker skips, one thread per test process, quiet Megatron warnings."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Test hooks (``tests.unit.reward._hooks:...``) are user plugins, and plugins import only from PYTHONPATH
# (the working directory is never searched: docs/security.md). Put the repository root there before any
# grader pool's fork server starts, so it and every worker it forks inherit it.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

_EXTRA_MODULES = {"vllm": "vllm", "vllm_slow": "vllm", "te": "transformer_engine", "launch": "nemo_run"}


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    for item in items:
        # Markers only: item.keywords also holds directory and function names (tests/unit/launch/...), so
        # a keyword match would skip every pure planner test in that folder when nemo-run is absent.
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        for marker, mod in _EXTRA_MODULES.items():
            if item.get_closest_marker(marker) is not None and not _has(mod):
                item.add_marker(pytest.mark.skip(reason=f"needs the '{marker}' extra ({mod} not importable)"))
