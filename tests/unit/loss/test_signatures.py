"""The loss package's call surface stays small, read from the source by AST: no function or lambda
in ``megatron_maspo/loss/`` takes more than 6 parameters (``self``/``cls`` of a method excluded),
and none takes ``*args`` / ``**kwargs`` (which would re-open the door the limit closes). A
micro-batch's inputs travel as one ``LossInputs``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LOSS = Path(__file__).resolve().parents[3] / "megatron_maspo" / "loss"
MAX_PARAMS = 6


def _violations(tree: ast.Module, where: str) -> list[str]:
    """``where:line name (why)`` for every function, method or lambda breaking the rule."""
    out = []
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
               if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        a = node.args
        names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        decorators = {getattr(d, "id", None) for d in getattr(node, "decorator_list", [])}
        if id(node) in methods and names and "staticmethod" not in decorators:
            names = names[1:]  # self, or cls of a classmethod
        name = getattr(node, "name", "<lambda>")
        if len(names) > MAX_PARAMS:
            out.append(f"{where}:{node.lineno} {name} ({len(names)} parameters)")
        if a.vararg is not None or a.kwarg is not None:
            out.append(f"{where}:{node.lineno} {name} (*args/**kwargs)")
    return out


def test_no_loss_function_takes_more_than_six_parameters():
    files = sorted(LOSS.rglob("*.py"))
    assert len(files) > 10, f"no loss modules found under {LOSS}"
    bad = [v for f in files
           for v in _violations(ast.parse(f.read_text()), str(f.relative_to(LOSS)))]
    assert not bad, bad


@pytest.mark.parametrize("src,why", [
    ("def f(a, b, c, d, e, f, g): pass", "7 parameters"),
    ("def f(a, *, b, c, d, e, f, g): pass", "7 parameters"),
    ("def f(a, **kw): pass", "*args/**kwargs"),
    ("def f(*args): pass", "*args/**kwargs"),
    ("g = lambda a, b, c, d, e, f, g: a", "7 parameters"),
    ("class C:\n    def m(self, a, b, c, d, e, f, g): pass", "7 parameters"),
])
def test_the_rule_catches(src, why):
    assert [v for v in _violations(ast.parse(src), "x") if why in v]


@pytest.mark.parametrize("src", [
    "def f(a, b, c, d, e, f): pass",
    "class C:\n    def m(self, a, b, c, d, e, f): pass",
    "class C:\n    @classmethod\n    def m(cls, a, b, c, d, e, f): pass",
])
def test_the_rule_allows(src):
    assert _violations(ast.parse(src), "x") == []
