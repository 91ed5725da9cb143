"""Re-read the pinned wheels' requirements from the package index and compare them with the recorded table.

    python scripts/check_gpu_stack.py            # needs the index; downloads metadata only (PEP 658)

For each wheel release in ``megatron_maspo.stack.RECORDED_REQUIRES`` it runs
``pip install --dry-run --no-deps --ignore-installed --report`` (pip fetches the ``.metadata`` file, not the
wheel) and checks that the release still declares, for every recorded dependency, the recorded specifier.
Run it after changing ``constraints/gpu.txt``, then update the table. Transformer Engine's torch extension
is an sdist whose requirements are computed at build time against the local torch: it is skipped.
Exit status: the number of differences (0 = the table matches the index).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_maspo.stack import RECORDED_REQUIRES  # noqa: E402

SDIST_ONLY = {"transformer-engine-torch"}
EXTRAS = {"transformer-engine": {"pytorch", "core-cu13"}}


def declared(name: str, version: str) -> dict[str, SpecifierSet]:
    """``{dependency: specifier}`` of one release, from the index's metadata (Linux, this Python)."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "r.json"
        # --ignore-requires-python: megatron-core 0.19 declares Python >=3.12; only its metadata is read here
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                        "--ignore-requires-python", "--quiet", "--report", str(report), f"{name}=={version}"],
                       check=True)
        meta = json.loads(report.read_text())["install"][0]["metadata"]
    out = {}
    for line in meta.get("requires_dist", []):
        r = Requirement(line)
        extras = {""} | EXTRAS.get(name, set())
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras):
            out[r.name.lower().replace("_", "-")] = r.specifier
    return out


def main() -> int:
    bad = 0
    for (name, version), needs in sorted(RECORDED_REQUIRES.items()):
        if name in SDIST_ONLY:
            print(f"skip  {name} {version}: sdist, requirements computed at build against the local torch")
            continue
        got = declared(name, version)
        for dep, spec in needs.items():
            have = got.get(dep)
            ok = have is not None and have == SpecifierSet(spec)
            bad += not ok
            print(f"{'ok   ' if ok else 'DIFF '} {name} {version}: {dep}{spec}"
                  + ("" if ok else f" (index says: {have})"))
    return bad


if __name__ == "__main__":
    sys.exit(main())
