"""The dependency ranges admit only what CI ran (issue: honest ranges).

``scripts/_venv.sh`` writes each CI venv's ``pip freeze`` to ``.ci/freeze/<stack>.txt`` (``main``: the default
venv; ``next``: megatron-core 0.19 with transformers 5.22, see constraints/next.txt). These tests read those
files, not a list kept here, so a range widened without CI running the new version fails, and so does a CI
change that stops running a version the range still admits. ``stack.BENCH_TESTED`` (what ``maspo doctor``
prints as tested) must name the same versions.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_maspo.stack import BENCH_TESTED

REPO = Path(__file__).resolve().parents[2]
FREEZE = REPO / ".ci" / "freeze"
STACKS = ("main", "next")


def _frozen() -> dict[str, dict[str, Version]]:
    """``{stack: {distribution: version}}`` of the CI venvs; skips unless every stack's freeze is there."""
    missing = [s for s in STACKS if not (FREEZE / f"{s}.txt").is_file()]
    if missing:
        pytest.skip(f"no .ci/freeze/{missing[0]}.txt: run through `bash scripts/test.sh` (it builds both stacks "
                    "and writes their pip freeze)")
    out = {}
    for s in STACKS:
        pins = {}
        for line in (FREEZE / f"{s}.txt").read_text().splitlines():
            name, sep, version = line.partition("==")
            if sep:
                pins[name.strip().lower().replace("_", "-")] = Version(version.strip().split("+")[0])
        out[s] = pins
    return out


def _range(name: str):
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(Requirement(d).specifier for d in deps if Requirement(d).name.lower() == name)


def test_megatron_core_range_admits_exactly_the_minors_ci_runs():
    frozen = _frozen()
    ran = {(v.major, v.minor) for pins in frozen.values() for v in [pins["megatron-core"]]}
    spec = _range("megatron-core")
    for minor in range(10, 40):
        admitted = [f"0.{minor}.{patch}" for patch in range(10) if spec.contains(f"0.{minor}.{patch}")]
        if admitted:
            assert (0, minor) in ran, (f"pyproject admits megatron-core {admitted[0]}, a minor no CI venv runs "
                                       f"(CI ran {sorted(ran)}): exclude it or add it to a CI stack")
    for m in ran:
        assert any(spec.contains(f"{m[0]}.{m[1]}.{p}") for p in range(10)), f"CI runs megatron-core {m}, excluded"


def test_transformers_upper_bound_is_the_newest_minor_ci_ran():
    newest = max(pins["transformers"] for pins in _frozen().values())
    spec = _range("transformers")
    assert spec.contains(str(newest)), f"the range {spec} excludes transformers {newest}, which CI runs"
    above = f"{newest.major}.{newest.minor + 1}.0"
    assert not spec.contains(above), (f"pyproject admits transformers {above}, above the newest CI ran "
                                      f"({newest}): lower the bound or run it in a CI stack")


def test_doctor_names_what_ci_ran():
    frozen = _frozen()
    for name, versions in BENCH_TESTED.items():
        ran = sorted({str(pins[name]) for pins in frozen.values() if name in pins}, key=Version)
        assert sorted(versions, key=Version) == ran, f"stack.BENCH_TESTED[{name!r}] = {versions}, CI ran {ran}"
