"""The installed transformers lies inside the range pyproject.toml declares (with an upper bound), and
the built-in engine's generate path uses only the supported cache API: no FutureWarning or
DeprecationWarning raised from transformers or our code, and no deprecation logged by transformers
(transformers 5.24 logs "`past_key_values`/`cache_params` are deprecated" for the old argument name:
``rollout/hf_cache.py``)."""

from __future__ import annotations

import logging
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_maspo.rollout.builtin_engine import BuiltinEngine
from megatron_maspo.rollout.types import SamplingParams

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def _declared() -> Requirement:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    assert len(reqs) == 1, deps
    return reqs[0]


def test_installed_transformers_is_within_the_declared_bounds():
    req = _declared()
    assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), \
        f"{req}: no upper bound; a future major release could break the CPU default"
    installed = Version(transformers.__version__)
    assert req.specifier.contains(installed, prereleases=True), \
        f"transformers {installed} is outside the declared {req.specifier}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_emits_no_deprecation(family, caplog):
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    engine = BuiltinEngine(model)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=0)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' once-per-process notices
    if hasattr(once, "cache_clear"):
        once.cache_clear()  # an earlier test in this process must not hide them from this one
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="transformers"):
        warnings.simplefilter("default")
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            # scoped to the code under test: warnings attributed to transformers or to our package
            warnings.filterwarnings("error", category=category, module=r"(transformers|megatron_maspo)(\.|$)")
        out = engine.generate([[3, 4, 5], [6]], params)
        engine.generate([[3, 4, 5], [6]], params)  # second call: once-per-process warnings are not hidden
    assert [len(c.token_ids) for per in out for c in per] == [5, 5, 5, 5]
    logged = [r.getMessage() for r in caplog.records if "deprecat" in r.getMessage().lower()
              or "will be removed" in r.getMessage()]
    assert not logged, logged
