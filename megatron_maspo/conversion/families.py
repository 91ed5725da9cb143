"""The HF <-> Megatron-Core (local and TE spec names) table of every registered family.

Each family declares its table in its own module (``model/families/<family>.py``, entries from
``model/families/names.py``); :data:`FAMILY_TABLES` is a view of the family registry, so a family
registered later has its table here too.
"""

from __future__ import annotations

from megatron_maspo.conversion.mapping import FamilyTable
from megatron_maspo.model.families.registry import LiveMapping, family_view
from megatron_maspo.model.spec import ArchSpec
from megatron_maspo.model.te_names import FUSED_NORMS

FAMILY_TABLES: LiveMapping[FamilyTable] = family_view(lambda f: f.names)
"""family -> its name table; a registry view."""

# Megatron names in the tables are the local spec's; the TE spec's spellings (norms fused into the next
# linear, grouped-GEMM experts ``mlp.experts.linear_fc1.weight{j}``) are derived from them by
# ``model/te_names.py`` (recorded from megatron-core 0.16.1), and ``conversion/plan.resolve`` accepts
# every spelling, so one table serves the local spec, the TE spec and TE with grouped GEMM.
TE_RENAMES: dict[str, str] = FUSED_NORMS


def family_table(spec: ArchSpec) -> FamilyTable:
    """The table for ``spec.family``; ``ValueError`` naming the family if there is none."""
    try:
        return FAMILY_TABLES[spec.family]
    except KeyError:
        raise ValueError(f"no conversion table for family={spec.family!r}; accepted: "
                         f"{sorted(FAMILY_TABLES)}") from None
