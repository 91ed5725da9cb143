"""The package's layering, read from the source (imports inside functions count: a lazy import is still
an arrow).

    cli  >  {launch, train}  >  {loss, parallel, model, conversion, rollout, reward, data, eval}
    recipes  >  config.py  >  every section's config module;  plugins.py, errors.py at the bottom

(``launch`` and ``train`` are side by side: neither imports the other; what the planner shares with the
trainer, such as the offload categories and the layout check, sits under ``parallel/``; ``config.py``
imports nothing from ``train/``: the trainer's sections live in ``train_config.py``)

plus the device seam (only ``parallel/device.py`` reaches the CPU shim, nothing calls the tensor-type
spoof) and the config rule (under ``train/`` only the component builders take the root config).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "megatron_maspo"
LOWER = {"loss", "parallel", "model", "conversion", "rollout", "reward", "data", "eval"}
# launch/ (the planner, the launchers) reads the config, never the trainer: it sits beside train/, not above it
UPPER_OF = {**{room: {"train", "launch", "cli"} for room in LOWER}, "train": {"launch", "cli"},
            "launch": {"train", "cli"}}
BOTTOM = {"plugins.py", "errors.py"}
# the only places under train/ whose functions may take the root MaspoConfig: the builders and the entry
ROOT_CONFIG_OK = {"train/components.py", "train/loop.py:Trainer.__init__", "train/loop.py:train"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(f, ast.parse(f.read_text())) for f in sorted(PKG.rglob("*.py"))]


def _imports(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`
    return [m for m in out if m.startswith("megatron_maspo.")]


@pytest.fixture(scope="module")
def modules():
    return _modules()


def test_no_import_runs_up_a_layer(modules):
    breaks = []
    for f, tree in modules:
        rel = f.relative_to(PKG).parts
        room = rel[0] if len(rel) > 1 else None
        for m in _imports(tree):
            target = m.split(".")[1]
            if room and target in UPPER_OF.get(room, ()):
                breaks.append(f"{'/'.join(rel)} -> {m}")
    assert not breaks, breaks


def test_planner_is_one_package():
    """``launch/plan/`` holds the planner; no ``launch/plan*.py`` module sits beside it."""
    assert (PKG / "launch" / "plan" / "__init__.py").is_file()
    assert not sorted(p.name for p in (PKG / "launch").glob("plan*.py"))


def test_config_sits_above_sections_and_below_recipes(modules):
    bad = []
    for f, tree in modules:
        rel = "/".join(f.relative_to(PKG).parts)
        for m in _imports(tree):
            if rel.endswith("config.py") and rel != "config.py" and m in ("megatron_maspo.config",):
                bad.append(f"section config {rel} imports the root config")
            if rel == "config.py" and m.split(".")[1] in ("recipes", "train"):
                bad.append(f"config.py imports {m}")
            if rel in BOTTOM and not any(m.startswith(f"megatron_maspo.{b[:-3]}") for b in BOTTOM):
                bad.append(f"{rel} (bottom layer) imports {m}")
    assert not bad, bad


def test_one_device_seam(modules):
    shim_users, spoof_calls = set(), []
    for f, tree in modules:
        rel = "/".join(f.relative_to(PKG).parts)
        if rel == "parallel/cpu_compat.py":
            continue
        if any(m.startswith("megatron_maspo.parallel.cpu_compat") for m in _imports(tree)):
            shim_users.add(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name == "spoof_tensor_type":
                    spoof_calls.append(rel)
                if name == "is_available" and isinstance(fn, ast.Attribute) and \
                        ast.unparse(fn.value) == "torch.cuda" and rel != "parallel/device.py":
                    spoof_calls.append(f"{rel}: torch.cuda.is_available() (ask parallel.device.on_cuda)")
    assert shim_users <= {"parallel/device.py"}, shim_users
    assert not spoof_calls, spoof_calls


def test_gpu_emulation_stays_under_parallel(modules):
    """``MASPO_EMULATE_GPU*`` is read, and ``gpu_emulation`` imported, only under ``parallel/``: the rest of
    the product reaches the emulation through ``comm`` (side streams, device buffers, hand-offs)."""
    bad = []
    for f, tree in modules:
        rel = "/".join(f.relative_to(PKG).parts)
        if rel.startswith("parallel/"):
            continue
        if any(m.startswith("megatron_maspo.parallel.gpu_emulation") for m in _imports(tree)):
            bad.append(f"{rel}: imports gpu_emulation")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "MASPO_EMULATE_GPU" in node.value:
                bad.append(f"{rel}:{node.lineno}: names {node.value!r}")
    assert not bad, bad


ENGINE_NAMES = {"builtin", "vllm"}


def _names_an_engine(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in ENGINE_NAMES or (
        isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_an_engine(e) for e in node.elts))


def test_engine_identity_lives_in_one_file(modules):
    """Outside ``rollout/engines.py`` nothing compares an engine's name with a string (``==``, ``!=``, ``in``,
    ``match``): the rest asks a trait. And nothing probes an engine or weight sink with getattr/hasattr:
    the ``Engine`` / ``WeightSink`` Protocols say what they have."""
    bad = []
    for f, tree in modules:
        rel = "/".join(f.relative_to(PKG).parts)
        for node in ast.walk(tree):
            if rel != "rollout/engines.py":
                if isinstance(node, ast.Compare) and "engine" in ast.unparse(node) and \
                        any(_names_an_engine(x) for x in (node.left, *node.comparators)):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
                if isinstance(node, ast.Match) and "engine" in ast.unparse(node.subject) and any(
                        isinstance(c.pattern, ast.MatchValue) and _names_an_engine(c.pattern.value)
                        for c in node.cases):
                    bad.append(f"{rel}:{node.lineno}: match on an engine name")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0]).split(".")[-1]
                if target in ("engine", "sink", "weight_sink"):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def _module_level_imports(tree: ast.Module, name: str, is_pkg: bool, known: set[str]) -> set[str]:
    """Package modules ``name`` imports when it is imported (not inside functions, not for type checkers)."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    visit(part)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)

    visit(tree.body)
    return {m for m in out if m in known and m != name}


def test_no_import_cycle(modules):
    """No cycle among the package's modules at import time (a function-level import is how a module
    defers one; the layering rules above still count those as arrows)."""
    names = {}
    for f, tree in modules:
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (f, tree)
    known = set(names)
    graph = {n: _module_level_imports(t, n, f.name == "__init__.py", known) for n, (f, t) in names.items()}
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[str] = []

    def walk(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(path[path.index(v):] + [v]))
            elif not state.get(v):
                walk(v)
        path.pop()
        state[u] = 2

    for n in sorted(graph):
        if not state.get(n):
            walk(n)
    assert not cycles, cycles


def test_only_builders_take_the_root_config_under_train(modules):
    takers = []
    for f, tree in modules:
        rel = "/".join(f.relative_to(PKG).parts)
        if not rel.startswith("train/"):
            continue

        def visit(node, prefix="", rel=rel):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.", rel)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = [*child.args.posonlyargs, *child.args.args, *child.args.kwonlyargs]
                    if any(a.annotation is not None and "MaspoConfig" in ast.unparse(a.annotation)
                           for a in args):
                        name = f"{rel}:{prefix}{child.name}"
                        if rel not in ROOT_CONFIG_OK and name not in ROOT_CONFIG_OK:
                            takers.append(name)
                    visit(child, f"{prefix}{child.name}.", rel)

        visit(tree)
    assert not takers, takers


def test_train_rooms_stay_small():
    top = [f.name for f in (PKG / "train").glob("*.py") if f.name != "__init__.py"]
    assert len(top) <= 12, top
    sizes = {f: sum(1 for _ in f.open()) for f in PKG.rglob("*.py")}
    assert max(sizes.values()) <= 600, max(sizes.items(), key=lambda kv: kv[1])
