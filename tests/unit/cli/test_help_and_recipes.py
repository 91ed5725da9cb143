"""``--help`` is plain text and ``maspo recipes`` lists every packaged recipe with one line."""

from __future__ import annotations

import re

from megatron_maspo.cli.main import build_parser, main, plain_text
from megatron_maspo.cli.recipes import recipe_lines
from megatron_maspo.recipes.registry import list_recipes


def test_plain_text_drops_markup():
    assert plain_text("``maspo train`` runs :func:`~megatron_maspo.train.loop.train`") == \
        "maspo train runs megatron_maspo.train.loop.train"


def test_every_subcommand_help_is_plain_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "train" in sub.choices and "recipes" in sub.choices
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "``" not in text and not re.search(r":[a-z]+:`", text), (name, text)


def test_recipes_lists_each_name_with_one_line(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list_recipes()
    assert all(len(ln.split(None, 1)) == 2 for ln in lines), lines  # a description on every line
    assert dict(recipe_lines())["tiny"].startswith("The CPU default")
