"""``docs/config.md``: every config field with its default and what it means, from the dataclasses.

The text is the docstring under each field (house style: one under every field), read from the source
with ``ast`` (nothing is executed), so the page cannot drift from the code: a test regenerates it and
compares. Regenerate after changing a config field::

    python -m megatron_maspo.config_doc > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache
from typing import Any

_HEADER = """# Configuration reference

Every field of the config tree, its default (the `tiny` recipe may set others: `maspo train
--print-config` shows a resolved config) and what it means. Set any of them with
`--set section.field=value`. Generated from the dataclasses' field docstrings by
`python -m megatron_maspo.config_doc > docs/config.md` (a test checks it is current).
"""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of dataclass ``cls``: the string literal right under each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the ClassDef
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and dataclasses.is_dataclass(hints[f.name]):
            out += _sections(hints[f.name], f"{prefix}{f.name}.")
    return out


def config_markdown(root: Any = None) -> str:
    """The whole reference page for ``root`` (default: ``MaspoConfig``)."""
    if root is None:
        from megatron_maspo.config import MaspoConfig as root
    lines = [_HEADER]
    for prefix, cls in _sections(root, "")[1:]:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        rows = [(f.name, f) for f in dataclasses.fields(cls) if f.init and not dataclasses.is_dataclass(hints[f.name])]
        if not rows:
            continue
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0]
        lines += [f"## `{prefix.rstrip('.')}`", "", _cell(summary), "", "| field | default | meaning |",
                  "|---|---|---|"]
        lines += [f"| `{prefix}{name}` | {_cell(_default(f))} | {_cell(docs.get(name, ''))} |" for name, f in rows]
        lines.append("")
    return "\n".join(lines)


def undocumented(root: Any = None) -> list[str]:
    """Dotted names of fields without a docstring (house style asks for one under every field)."""
    if root is None:
        from megatron_maspo.config import MaspoConfig as root
    missing = []
    for prefix, cls in _sections(root, ""):
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        missing += [f"{prefix}{f.name}" for f in dataclasses.fields(cls)
                    if f.init and not dataclasses.is_dataclass(hints[f.name]) and f.name not in docs]
    return missing


if __name__ == "__main__":
    print(config_markdown(), end="")
