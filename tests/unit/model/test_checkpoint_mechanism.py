"""One mechanism each: unwrapping, the model sharded state dict and the atomic save live in
``model/checkpoint.py``; no import cycle in the package (``conversion/dist_ckpt`` <-> ``megatron_to_hf`` was
one); the collective atomic save on 2 gloo ranks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megatron_maspo
from megatron_maspo.model.checkpoint import atomic_dir, collective_atomic_dir
from megatron_maspo.parallel.launch import (  # the package helper itself (fresh worlds)
    WorkerError,
    run_workers,
)

PKG = Path(megatron_maspo.__file__).parent
SHARED = "megatron_maspo/model/checkpoint.py"


def _sources() -> dict[str, str]:
    return {f"megatron_maspo/{p.relative_to(PKG)}": p.read_text() for p in PKG.rglob("*.py")}


def _module_graph() -> dict[str, set[str]]:
    """Intra-package imports, module level and function level alike (a lazy import is still an edge)."""
    names = {}
    for rel in _sources():
        mod = rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        names[mod] = rel
    graph: dict[str, set[str]] = {m: set() for m in names}
    for mod, rel in names.items():
        for node in ast.walk(ast.parse((PKG.parent / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_maspo"):
                subs = {f"{node.module}.{a.name}" for a in node.names}
                # ``from pkg import submodule`` depends on the submodule; the package itself only when
                # a name other than a submodule is taken from it.
                targets = subs if subs <= set(names) else {node.module, *subs}
                graph[mod] |= {t for t in targets if t in names and t != mod}
            elif isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in names and a.name != mod}
    return graph


def test_no_import_cycle_in_the_package():
    graph = _module_graph()
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n):], n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert "megatron_maspo.conversion.megatron_to_hf" in graph["megatron_maspo.conversion.dist_ckpt"]


@pytest.mark.parametrize("pattern, what", [
    (r"^def unwrap\(", "model unwrapping"),
    (r"\.sharded_state_dict\(\)", "the model sharded-state-dict builder"),
    (r"^def (collective_)?atomic_dir\(", "the atomic-save protocol"),
])
def test_one_definition_of_each_mechanism(pattern, what):
    hits = [rel for rel, src in _sources().items() if re.search(pattern, src, flags=re.M)]
    assert hits == [SHARED], f"{what} must live only in {SHARED}; found in {hits}"


def test_single_process_atomic_dirs_clean_up_on_error(tmp_path):
    for make in (atomic_dir, collective_atomic_dir):
        with pytest.raises(KeyError), make(tmp_path / "x") as tmp:
            (tmp / "f").write_text("partial")
            raise KeyError("boom")
        assert list(tmp_path.iterdir()) == []


def _worker(rank: int, world: int, root: str) -> dict:
    final = Path(root) / "ckpt"
    commits = []
    with collective_atomic_dir(final, on_commit=lambda: commits.append(rank)) as tmp:
        assert tmp.name.startswith(".ckpt.tmp-")
        (tmp / f"part{rank}").write_text(str(rank))
    out = {"files": sorted(p.name for p in final.iterdir()), "commits": commits,
           "siblings": sorted(p.name for p in Path(root).iterdir())}
    try:
        with collective_atomic_dir(final):
            raise AssertionError("body must not run when the folder exists")
    except ValueError as e:
        out["refused"] = str(e)
    with collective_atomic_dir(final, overwrite=True, tmp_name=".tmp_ckpt") as tmp:
        (tmp / f"new{rank}").write_text("x")
    out["after_overwrite"] = sorted(p.name for p in final.iterdir())
    return out


def test_collective_atomic_dir_two_ranks(tmp_path):
    res = run_workers(_worker, 2, str(tmp_path))
    for r, out in enumerate(res):
        assert out["files"] == ["part0", "part1"]
        assert out["commits"] == ([0] if r == 0 else [])
        assert out["siblings"] == ["ckpt"], "no temp folder may remain after a commit"
        assert "already exists" in out["refused"]
        assert out["after_overwrite"] == ["new0", "new1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _failing_worker(rank: int, world: int, root: str) -> None:
    with collective_atomic_dir(Path(root) / "ckpt") as tmp:
        if rank == 1:
            raise OSError("disk full on rank 1")
        (tmp / "part0").write_text("0")


@pytest.mark.slow
def test_failure_on_one_rank_never_produces_the_final_folder(tmp_path):
    with pytest.raises(WorkerError, match="disk full on rank 1"):
        run_workers(_failing_worker, 2, str(tmp_path), timeout_s=60)
    assert not (tmp_path / "ckpt").exists()
