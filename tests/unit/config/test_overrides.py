"""--set overrides: coercion against field types, errors naming the key and accepted values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from megatron_maspo.overrides import apply_overrides, from_dict, to_dict


@dataclass(kw_only=True)
class Inner:
    lr: float = 1e-3
    steps: int = 3
    name: str | None = None
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"inner.steps must be >= 0, got {self.steps}")


@dataclass(kw_only=True)
class Root:
    inner: Inner = field(default_factory=Inner)
    top: int = 1


def test_types_are_coerced():
    cfg = apply_overrides(Root(), ["inner.lr=2e-5", "inner.steps=7", "inner.name=none",
                                   "inner.mode=b", "inner.flag=true", "inner.ids=1,2,3", "top=4"])
    assert cfg.inner.lr == 2e-5 and cfg.inner.steps == 7 and cfg.inner.name is None
    assert cfg.inner.mode == "b" and cfg.inner.flag is True and cfg.inner.ids == [1, 2, 3] and cfg.top == 4
    assert Root().inner.steps == 3  # the original is untouched


@pytest.mark.parametrize("assignment, fragment", [
    ("inner.nope=1", "accepts ['lr', 'steps', 'name', 'mode', 'flag', 'ids']"),
    ("nope=1", "unknown config key 'nope'"),
    ("inner.steps=abc", "inner.steps: 'abc' is not an integer"),
    ("inner.mode=c", "not one of ['a', 'b']"),
    ("inner.flag=maybe", "not a boolean"),
    ("inner.steps=-1", "inner.steps must be >= 0"),
    ("inner=3", "is a section"),
    ("justtext", "must look like section.field=value"),
])
def test_errors_name_the_key(assignment, fragment):
    with pytest.raises(ValueError) as e:
        apply_overrides(Root(), [assignment])
    assert fragment in str(e.value)


def test_dict_round_trip_and_unknown_keys():
    cfg = apply_overrides(Root(), ["inner.lr=0.5", "inner.ids=4"])
    assert from_dict(Root, to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown config key"):
        from_dict(Root, {"inner": {"lr": 1.0, "typo": 2}})
