"""Locations of the MASPO paper (arXiv 2602.17550) that our labels may cite (not a recipe: private module).

The paper's text cannot ship in this repository, so the check is against this list: the section,
appendix and table numbers that exist in the text we audited (headings, and tables printed in it).
`tests/unit/launch/test_recipes.py` checks that every "paper ..." label of the recipes and every
"MASPO §..." label in `loss/params.py` cites one of them. Table 4 (the baselines' settings) is named
by the paper (App. C.3) but is *missing* from its text, so no value may cite it.
"""

from __future__ import annotations

import re

PAPER_LOCATIONS = frozenset({
    "§1", "§2", "§2.1", "§2.2", "§3", "§4", "§4.1", "§4.2", "§5", "§5.1", "§5.2", "§5.3", "§5.4", "§6",
    "App. A", "App. A.1", "App. A.2", "App. A.3",
    "App. B",  # its heading is lost in the text; its derivation (A± of x correct out of n) follows A.3
    "App. C", "App. C.1", "App. C.2", "App. C.3",
    "App. D", "App. D.1", "App. D.2", "App. D.3", "App. D.4", "App. D.5",
    "Table 1", "Table 5",
})
"""Where the MASPO text we have states something (sections, appendices, printed tables)."""

MISSING_LOCATIONS = frozenset({"Table 4"})
"""Named by the paper but absent from its text: cannot be the source of a value."""

_LOC = re.compile(r"(§\d+(?:\.\d+)?|App\. [A-D](?:\.\d+)?|Table \d+)")


def cited_locations(label: str) -> list[str]:
    """Every section / appendix / table a label names, in order (e.g. ['§5.3', 'Table 5'])."""
    return _LOC.findall(label)


def unknown_locations(label: str) -> list[str]:
    """Cited locations of ``label`` that the paper text lacks (empty when every citation exists)."""
    return [loc for loc in cited_locations(label) if loc not in PAPER_LOCATIONS]
