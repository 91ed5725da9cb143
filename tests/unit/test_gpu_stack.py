"""The supported GPU stack: constraints/gpu.txt, the recorded wheel requirements, the extras, ``maspo doctor``.

What these tests show: every pin satisfies every requirement the other pinned releases declare in their
published wheel metadata (recorded in ``megatron_maspo/stack.py``), the package's own extras accept the
pins, and the recorded facts agree with any of those releases installed here. What they cannot show:
that Transformer Engine's torch extension, compiled on the user's machine, matches the installed torch
(only importing it can: ``maspo doctor`` does on a GPU), and that anything runs on a GPU.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from megatron_maspo import stack
from megatron_maspo.stack import RECORDED_REQUIRES, SUPPORTED, StackReport, findings

REPO = Path(__file__).resolve().parents[2]


def _constraints() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints" / "gpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip()] = version.strip()
    return out


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_constraints_file_is_the_supported_set():
    assert _constraints() == SUPPORTED


@pytest.mark.parametrize(("release", "needs"), sorted((r, n) for r, n in RECORDED_REQUIRES.items()
                                                     if SUPPORTED.get(r[0]) == r[1]))
def test_each_pinned_release_accepts_the_other_pins(release, needs):
    name, version = release
    assert SUPPORTED[name] == version, f"recorded requirements of {name} {version}, but {SUPPORTED[name]} pinned"
    for dep, spec in needs.items():
        assert SpecifierSet(spec).contains(SUPPORTED[dep]), f"{name} {version} needs {dep}{spec}"


def test_the_extras_accept_the_pins_and_vllm_fixes_torch():
    proj = _pyproject()
    reqs = [Requirement(r) for r in proj["dependencies"]]
    extras = {k: [Requirement(r) for r in v] for k, v in proj["optional-dependencies"].items()}
    for r in reqs + extras["vllm"] + extras["te"]:
        key = r.name.lower()
        if key in SUPPORTED:
            assert r.specifier.contains(SUPPORTED[key]), f"{r} rejects the supported {key} {SUPPORTED[key]}"
    torch_in_vllm = [r for r in extras["vllm"] if r.name == "torch"]
    # the extra names exactly the torch vllm pins: it can resolve no other
    assert [str(r.specifier) for r in torch_in_vllm] == [f"=={SUPPORTED['torch']}"]
    assert RECORDED_REQUIRES[("vllm", SUPPORTED["vllm"])]["torch"] == f"=={SUPPORTED['torch']}"


def test_recorded_requirements_match_installed_dists_where_present():
    """Network-free: a pinned release installed here must declare what the table says it does."""
    checked = 0
    for (name, version), needs in RECORDED_REQUIRES.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        declared = {}
        for line in dist.requires or []:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                declared[r.name.lower().replace("_", "-")] = SpecifierSet(str(r.specifier))
        for dep, spec in needs.items():
            if dep in declared:
                assert declared[dep] == SpecifierSet(spec), (name, dep, declared[dep], spec)
                checked += 1
    if checked == 0:
        pytest.skip("no pinned release installed here with a recorded requirement")


def _report(**versions) -> StackReport:
    return StackReport(versions={n: None for n in stack.WATCHED} | versions, cuda="13.0", nccl="2.30.7")


def test_ngc_style_torch_under_vllm_is_broken_and_a_newer_transformers_only_a_mismatch():
    rep = _report(torch="2.14.0a0+nv25.12", vllm="0.33.0", transformers="5.20.2")
    rep.requires = {"vllm": ["torch==2.14.0", "transformers<5.21.0,>=5.16.1", "zentorch; extra == \"zen\""]}
    found = findings(rep)
    assert [m for k, m in found if k == "broken"] == [
        "vllm 0.33.0 requires torch==2.14.0, found torch 2.14.0a0+nv25.12"]
    rep = _report(torch="2.14.0", vllm="0.34.0", transformers="5.21.0", **{"megatron-core": "0.19.2"})
    rep.requires = {"vllm": ["torch==2.14.0"]}
    kinds = dict((m.split()[0], k) for k, m in findings(rep))
    assert kinds["transformers"] == "mismatch" and "broken" not in kinds.values()


def test_supported_set_has_no_finding_and_a_te_import_failure_is_broken():
    pinned = {n: v for n, v in SUPPORTED.items() if n in stack.WATCHED}
    rep = _report(**pinned)
    rep.requires = {"vllm": ["torch==2.14.0", "transformers<5.23.0,>=5.16.1"], "megatron-core": ["torch>=2.6.0"]}
    assert findings(rep, python="3.12.7") == []
    rep.te_error = "ImportError: undefined symbol: _ZN3c10"
    assert [k for k, _ in findings(rep, python="3.12.7")] == ["broken"]
    assert stack.verdict(rep, findings(rep, python="3.12.7")).startswith("verdict: BROKEN: transformer-engine")


def test_an_untested_megatron_core_and_old_python_say_what_to_move():
    pinned = {n: v for n, v in SUPPORTED.items() if n in stack.WATCHED}
    rep = _report(**(pinned | {"megatron-core": "0.18.0"}))
    found = findings(rep, python="3.11.9")
    msgs = [m for _, m in found]
    assert msgs[0].startswith("Python 3.11.9: move to 3.12")
    assert "megatron-core 0.18.0: move to 0.19.2 (pip install -c constraints/gpu.txt megatron-core==0.19.2; " \
           "a version no CI of this project ran)" in msgs
    line = stack.verdict(rep, found)
    assert line.startswith("verdict: runs, but an untested mix: 2 differences") and "megatron-core 0.18.0" in line


def test_train_check_does_not_refuse_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert stack.refuse_broken_stack() is None


def test_maspo_doctor_runs_on_cpu_and_lists_the_stack():
    out = subprocess.run([sys.executable, "-m", "megatron_maspo.cli.main", "doctor", "--no-te"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    for row in ("torch", "CUDA", "NCCL", "driver", "vLLM", "Transformer Engine", "Apex", "megatron-core",
                "transformers", "GPUs"):
        assert any(line.startswith(row) for line in out.stdout.splitlines()), row
    assert "supported set: constraints/gpu.txt" in out.stdout
    assert "tested on the CPU bench (CI): megatron-core 0.16.1, 0.19.2" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: ")
