"""The pipeline split (``parallel/pipeline_split.py``) against megatron-core's own layer offsets and
counts, even and uneven, with and without virtual chunks; its refusals name the fix."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_maspo.parallel.pipeline_split import PipelineSplit, describe, suggestions


def _megatron(num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None):
    """Per (stage, chunk): megatron-core's (offset, layers to build) for this split."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                            pipeline_dtype=torch.float32)
    return {(s, v): (get_transformer_layer_offset(cfg, vp_stage=v if vpp else None, pp_rank=s),
                     get_num_layers_to_build(cfg, vp_stage=v if vpp else None, pp_rank=s))
            for s in range(pp) for v in range(vpp or 1)}


CASES = [(5, 2, None, 3, None), (5, 3, None, 1, None), (5, 3, None, None, 1), (5, 3, None, 1, 2),
         (61, 16, None, 1, None), (61, 16, None, 2, 3), (94, 8, None, 11, 11), (94, 8, None, 10, None),
         (8, 2, 2, None, None), (12, 3, 2, 2, 4), (14, 4, 2, 2, 4), (16, 4, None, None, None),
         (10, 3, 2, 2, 4)]


@pytest.mark.parametrize("num_layers,pp,vpp,first,last", CASES)
def test_offsets_and_counts_are_megatrons(num_layers, pp, vpp, first, last):
    split = PipelineSplit(num_layers, pp, vpp, first, last)
    ours = {(s, v): (split.offset(s, v if vpp else None), split.chunk_layers(s))
            for s in range(pp) for v in range(vpp or 1)}
    assert ours == _megatron(num_layers, pp, vpp, first, last)
    assert sum(split.stage_layers()) == num_layers
    covered = sorted(itertools.chain.from_iterable(range(o, o + n) for o, n in ours.values()))
    assert covered == list(range(num_layers))  # every layer once
    for (s, _v), (o, n) in ours.items():
        assert all(split.stage_of(layer) == s for layer in range(o, o + n))


def test_the_two_published_uneven_layouts():
    assert PipelineSplit(61, 16, first=1).stage_layers() == (1,) + (4,) * 15
    assert describe(PipelineSplit(94, 8, first=11, last=11).stage_layers()) == "11 + 6x12 + 11"
    assert PipelineSplit(94, 8, first=11, last=11).max_stage_layers == 12


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=61, pp=16), r"not divisible.*pp_first_layers=2 parallel.pp_last_layers=3: 2 \+ 14x4 \+ 3"),
    (dict(num_layers=5, pp=1, first=3), "need pp >= 2"),
    (dict(num_layers=5, pp=2, first=0), "at least one layer"),
    (dict(num_layers=5, pp=2, first=2, last=2), r"!= num_layers=5"),
    (dict(num_layers=7, pp=3, first=2), "5 layers, which do not split evenly over the 2 other stages"),
    (dict(num_layers=12, pp=3, vpp=2, first=3), "does not split over vpp=2"),
])
def test_refusals_name_the_setting_and_a_split_that_works(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineSplit(**kwargs)


def test_suggestions_are_valid_and_most_balanced_first():
    for layers, pp in ((61, 16), (94, 8), (5, 2), (5, 3), (27, 4)):
        options = suggestions(layers, pp)
        assert options, (layers, pp)
        best = PipelineSplit(layers, pp, None, *options[0])
        assert all(best.max_stage_layers <= PipelineSplit(layers, pp, None, *o).max_stage_layers for o in options)
    assert suggestions(94, 8)[0] == (11, 11) and suggestions(5, 1) == []
