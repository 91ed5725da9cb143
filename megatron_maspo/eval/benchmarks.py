"""Find the MASPO paper's six evaluation benchmarks in a folder, by their usual file names.

The paper (§5.1) reports AIME24, AIME25, AMC23, MATH500, Minerva and OlympiadBench. Public copies
come as ``.jsonl`` / ``.json`` / ``.parquet`` files named after the benchmark, either directly
(``aime24.jsonl``, ``math500.parquet``, ``olympiadbench.json``) or as a split inside a folder named
after it (``AIME_2024/test.parquet``, ``minerva_math/test.jsonl``). Field names differ per benchmark
(``problem``/``question``, ``answer``/``final_answer``/``solution``); `data.loaders` detects them.

:func:`find_benchmarks` matches the path below the folder (folder and file names, lower-cased, with
separators removed) against each benchmark's aliases, so ``aime_2024``, ``AIME-24`` and ``aime24``
all match. A benchmark with several candidate files prefers a ``test`` split; otherwise it is an
error naming the candidates, never a silent pick.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_maspo.errors import ConfigError, MissingPathError

BENCHMARKS: dict[str, tuple[str, ...]] = {
    # canonical name: aliases, compared with the separator-free lower-cased path parts
    "aime24": ("aime24", "aime2024"),
    "aime25": ("aime25", "aime2025"),
    "amc23": ("amc23", "amc2023", "amc"),
    "math500": ("math500",),
    "minerva": ("minerva", "minervamath"),
    "olympiadbench": ("olympiadbench", "olympiad"),
}
EXTENSIONS = (".jsonl", ".json", ".parquet")


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _matches(rel: Path, aliases: tuple[str, ...]) -> bool:
    parts = [_norm(p) for p in (*rel.parent.parts, rel.stem)]
    return any(p == a or p.startswith(a) for p in parts for a in aliases)


def find_benchmarks(root: str | Path, names: tuple[str, ...] | None = None) -> dict[str, Path]:
    """``{benchmark: file}`` for every benchmark of ``names`` (default: all six) found under ``root``.

    Raises:
        FileNotFoundError: ``root`` is not a folder, or none of the benchmarks is found.
        ValueError: an unknown name, or several files match one benchmark and none is a ``test`` split.
    """
    root = Path(root)
    if not root.is_dir():
        raise MissingPathError(f"--benchmarks {root}: not a folder")
    names = names or tuple(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
    found: dict[str, Path] = {}
    for name in names:
        # 'aime24' must not also match 'aime25' files: aliases are specific enough except 'amc'
        cands = [f for f in files if _matches(f.relative_to(root), BENCHMARKS[name])]
        if len(cands) > 1:
            tests = [f for f in cands if _norm(f.stem) == "test" or _norm(f.stem).endswith("test")]
            if len(tests) != 1:
                raise ConfigError(f"{len(cands)} files match benchmark {name!r} under {root}: "
                                 f"{[str(c.relative_to(root)) for c in cands]}; keep one (or one 'test' split)")
            cands = tests
        if cands:
            found[name] = cands[0]
    if not found:
        raise MissingPathError(f"no benchmark file under {root} (looked for {list(BENCHMARKS)} as "
                                f"{'/'.join(EXTENSIONS)} files or folders)")
    return found
