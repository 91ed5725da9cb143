"""maspo recipes: the packaged recipes, one line each (pass a name to --recipe).

    maspo recipes
    maspo train --recipe smollm2
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="list the packaged recipes, one line each", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)


def recipe_lines() -> list[tuple[str, str]]:
    """``[(name, first line of its docstring)]`` for every packaged recipe; read, not imported."""
    import megatron_maspo.recipes as pkg
    from megatron_maspo.recipes.registry import list_recipes

    folder = Path(pkg.__file__).parent
    out = []
    for name in list_recipes():
        doc = ast.get_docstring(ast.parse((folder / f"{name}.py").read_text())) or ""
        out.append((name, doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


def run(args: argparse.Namespace) -> int:
    rows = recipe_lines()
    width = max(len(n) for n, _ in rows)
    for name, line in rows:
        print(f"{name:<{width}}  {line}")
    return 0
