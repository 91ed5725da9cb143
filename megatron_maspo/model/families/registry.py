"""The model-family registry: the built-in declarations, ``register``/``unregister``, and live views.

Every list of families the package reads is derived from here, in the module that always held it:
``model.spec.SUPPORTED_FAMILIES``, ``conversion.families.FAMILY_TABLES``, ``model.hf_config.HF_MODEL_TYPES``,
``model.tiny_hf.TINY_DEFAULTS``, ``cli.convert.TINY_FAMILIES`` and ``model.presets.PRESETS`` /
``PLANNING_LAYOUTS``. They are :class:`LiveMapping` / :class:`LiveNames` views, recomputed on every read,
so a family registered later (a test's dummy, a user's plugin module) appears in all of them at once.
Torch-free, and imports nothing that imports ``model/spec.py``: ``ArchSpec`` validates its family here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from megatron_maspo.model.families import (
    deepseek_v3,
    glm4_moe,
    llama,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
)
from megatron_maspo.model.families.declaration import ModelFamily

BUILT_IN: tuple[ModelFamily, ...] = (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, glm4_moe.FAMILY,
                                     deepseek_v3.FAMILY, qwen3_5.FAMILY, qwen3_5_moe.FAMILY)
"""The families shipped with the package, in the order the derived lists show them."""

_FAMILIES: dict[str, ModelFamily] = {}

V = TypeVar("V")


def _claimed(family: ModelFamily) -> list[str]:
    """What ``family`` would take that another registered family already holds."""
    clashes = []
    if family.name in _FAMILIES:
        clashes.append(f"name {family.name!r}")
    for other in _FAMILIES.values():
        clashes += [f"model_type {t!r} (family {other.name!r})" for t in family.model_types if t in other.model_types]
        theirs = {*other.presets, *other.planning_layouts}
        clashes += [f"preset {p!r} (family {other.name!r})" for p in (*family.presets, *family.planning_layouts)
                    if p in theirs]
    return clashes


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to every derived list; returns it (a module can end with ``register(FAMILY)``).

    Raises:
        ValueError: its name, an HF ``model_type`` or a preset name is already registered, its name table
            names another family, it declares no ``model_types``/``architectures``, or a preset name is not
            lower case (``model.arch`` is matched case-insensitively).
    """
    if not family.model_types or not family.architectures:
        raise ValueError(f"family {family.name!r} declares no model_types or no architectures")
    if family.names.family != family.name:
        raise ValueError(f"family {family.name!r} holds the name table of {family.names.family!r}")
    upper = [p for p in (*family.presets, *family.planning_layouts) if p != p.lower()]
    if upper:
        raise ValueError(f"family {family.name!r}: preset names must be lower case, got {upper}")
    clashes = _claimed(family)
    if clashes:
        raise ValueError(f"family {family.name!r} cannot be registered: already taken: {', '.join(clashes)}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> ModelFamily:
    """Remove family ``name`` from every derived list; returns its declaration."""
    get_family(name)
    return _FAMILIES.pop(name)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, built-ins first, in registration order."""
    return tuple(_FAMILIES.values())


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The declaration of family ``name``; ``ValueError`` listing the registered ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"family={name!r} is not supported; accepted: {sorted(_FAMILIES)}") from None


def family_of_model_type(model_type: Any) -> ModelFamily:
    """The family reading HF ``model_type``; ``ValueError`` listing the accepted model types."""
    by_type = {t: f for f in _FAMILIES.values() for t in f.model_types}
    if model_type not in by_type:
        raise ValueError(f"HF model_type={model_type!r} is not supported; accepted: {sorted(by_type)}")
    return by_type[model_type]


class LiveMapping(Mapping[str, V]):
    """A read-only mapping recomputed from the registry on every access (``build`` returns the dict)."""

    def __init__(self, build: Callable[[], dict[str, V]]) -> None:
        self._build = build

    def __getitem__(self, key: str) -> V:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return f"LiveMapping({self._build()!r})"


class LiveNames(Sequence[str]):
    """A read-only tuple of names recomputed from the registry on every access."""

    def __init__(self, build: Callable[[], tuple[str, ...]]) -> None:
        self._build = build

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as tuple's
        return self._build()[i]

    def __len__(self) -> int:
        return len(self._build())

    def __contains__(self, name: object) -> bool:
        return name in self._build()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, LiveNames)) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._build())


def family_view(pick: Callable[[ModelFamily], V | None]) -> LiveMapping[V]:
    """``{family name: pick(family)}`` over the registered families, leaving out those where it is None."""
    return LiveMapping(lambda: {f.name: v for f in _FAMILIES.values() if (v := pick(f)) is not None})


for _family in BUILT_IN:
    register(_family)
