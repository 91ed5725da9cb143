"""Which decoder layers each pipeline stage (and virtual chunk) holds: Megatron-Core's rule, as a value.

Even split: ``L`` layers over ``pp`` stages x ``vpp`` virtual chunks, ``L / (pp·vpp)`` layers per chunk.
Uneven split (Megatron's ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``):
the first and/or last stage hold the given counts, the stages between share the rest evenly::

    L = first + (pp - [first set] - [last set]) · middle + last        61 = 1 + 15·4      (DeepSeek-V3, PP 16)
                                                                       94 = 10 + 7·12     (Qwen3-235B, PP 8)

With virtual chunks every stage's count is split evenly over its ``vpp`` chunks, and the global order
is chunk-major: chunk ``v`` of every stage, stage 0 first, then chunk ``v + 1``. So the global index
of the first layer of stage ``s``, chunk ``v`` is ``v·L/vpp + sum_{s' < s} n_{s'}/vpp``, where ``n_s`` is
stage ``s``'s count; the tests check this against megatron-core's own offset functions.

Pure arithmetic, no torch or megatron import: the trainer's build, the transfer plan, ``maspo check`` and
the planner all read the split from here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    """``num_layers`` decoder layers over ``pp`` stages x ``vpp`` chunks, optionally uneven.

    Raises:
        ValueError: naming the constraint (``parallel.pp_first_layers`` / ``pp_last_layers``) that fails.
    """

    num_layers: int
    pp: int = 1
    vpp: int | None = None
    first: int | None = None
    """Layers of the first stage (Megatron's ``num_layers_in_first_pipeline_stage``); None = even share."""
    last: int | None = None
    """Layers of the last stage (``num_layers_in_last_pipeline_stage``); None = even share."""

    def __post_init__(self) -> None:
        problem = _problem(self.num_layers, self.pp, self.vpp, self.first, self.last)
        if problem is not None:
            raise ValueError(problem + self._hint())

    def _hint(self) -> str:
        options = suggestions(self.num_layers, self.pp, self.vpp)
        if not options:
            return ""
        first, last = options[0]
        parts = [f"parallel.pp_first_layers={first}"] * (first is not None)
        parts += [f"parallel.pp_last_layers={last}"] * (last is not None)
        return f" (e.g. {' '.join(parts)}: {describe(_counts(self.num_layers, self.pp, first, last))} layers)"

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def stage_layers(self) -> tuple[int, ...]:
        """Layers per stage, stage 0 first."""
        return _counts(self.num_layers, self.pp, self.first, self.last)

    def chunk_layers(self, stage: int) -> int:
        """Layers of each virtual chunk of ``stage``."""
        return self.stage_layers()[stage] // (self.vpp or 1)

    def offset(self, stage: int, vp: int | None = None) -> int:
        """Global index of the first layer of ``stage``'s chunk ``vp`` (None without virtual chunks)."""
        v = self.vpp or 1
        counts = self.stage_layers()
        return (vp or 0) * (self.num_layers // v) + sum(counts[:stage]) // v

    def stage_of(self, layer: int) -> int:
        """The stage holding global layer ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return _layer_stages(self)[layer]

    @property
    def max_stage_layers(self) -> int:
        """The busiest stage's layer count (what bounds memory and pipeline time)."""
        return max(self.stage_layers())

    def megatron_kwargs(self) -> dict:
        """``TransformerConfig`` fields of this split (empty for an even one)."""
        out = {}
        if self.first is not None:
            out["num_layers_in_first_pipeline_stage"] = self.first
        if self.last is not None:
            out["num_layers_in_last_pipeline_stage"] = self.last
        return out


@functools.lru_cache(maxsize=64)
def _layer_stages(split: PipelineSplit) -> tuple[int, ...]:
    """Stage of every global layer (the transfer plan asks once per tensor: tens of thousands for MoE)."""
    out = [0] * split.num_layers
    for vp in range(split.vpp or 1):
        for s in range(split.pp):
            start = split.offset(s, vp)
            out[start:start + split.chunk_layers(s)] = [s] * split.chunk_layers(s)
    return tuple(out)


def _problem(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None) -> str | None:
    """Why this split is not one Megatron-Core builds, or None."""
    v = vpp or 1
    uneven = first is not None or last is not None
    if uneven and pp < 2:
        return f"parallel.pp_first_layers / pp_last_layers need pp >= 2 (pp={pp})"
    for name, n in (("pp_first_layers", first), ("pp_last_layers", last)):
        if n is not None and n < 1:
            return f"parallel.{name}={n}: every stage needs at least one layer"
        if n is not None and n % v:
            return f"parallel.{name}={n} does not split over vpp={v} virtual chunks"
    if not uneven:
        if num_layers % (pp * v):
            return (f"num_layers={num_layers} is not divisible by pipeline stages x virtual chunks = {pp} x {v}; "
                    "set parallel.pp_first_layers and/or parallel.pp_last_layers for an uneven split")
        return None
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0 and middle != 0:
        return f"parallel.pp_first_layers={first} + pp_last_layers={last} != num_layers={num_layers} at pp=2"
    if middle_stages and (middle < middle_stages or middle % (middle_stages * v)):
        return (f"num_layers={num_layers} minus the first/last stages' {(first or 0) + (last or 0)} leaves "
                f"{middle} layers, which do not split evenly over the {middle_stages} other stages x {v} "
                "virtual chunks")
    return None


def _counts(num_layers: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    each = middle // middle_stages if middle_stages else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def describe(counts: tuple[int, ...]) -> str:
    """``(1, 4, 4, 4)`` -> ``"1 + 3x4"``: a split as people write it."""
    ends = [counts[0]] if len(counts) > 1 and counts[0] != counts[1] else []
    tail = [counts[-1]] if len(counts) > 1 and counts[-1] != counts[-2] else []
    middle = counts[len(ends):len(counts) - len(tail)]
    parts = [str(n) for n in ends] + ([f"{len(middle)}x{middle[0]}"] if middle else []) + [str(n) for n in tail]
    return " + ".join(parts)


def suggestions(num_layers: int, pp: int, vpp: int | None = None) -> list[tuple[int | None, int | None]]:
    """Uneven ``(first, last)`` choices for ``num_layers`` over ``pp`` stages, the most balanced first
    (smallest busiest stage, then the fewest layers moved off the even share); empty at pp < 2. The
    first and last stages carry the embedding and the LM head, so a lighter end stage is the usual
    published choice (DeepSeek-V3 at PP 16: one layer on the first stage, four on each other)."""
    if pp < 2:
        return []
    found = []
    for first in (None, *range(1, num_layers)):
        for last in (None, *range(1, num_layers)):
            if (first is None and last is None) or _problem(num_layers, pp, vpp, first, last) is not None:
                continue
            counts = _counts(num_layers, pp, first, last)
            if len(set(counts)) == 1:  # the even split spelt unevenly: not a suggestion
                continue
            ends = (first is not None) + (last is not None)
            found.append(((max(counts), max(counts) - min(counts), ends, first is None), (first, last)))
    return [fl for _, fl in sorted(found)]
