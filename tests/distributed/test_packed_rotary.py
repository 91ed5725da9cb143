"""Rotary positions restart at every packed sequence: a sequence's log-probs do not depend on where it
sits in the row (offset 0 vs offset > 10,000), in fp32 and in bf16, on the packed attention path. The
dense-mask path (absolute rotary offsets) is run alongside in bf16 to show the check can fail."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._launch import run_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FILLER = [1280] * 8  # 10,240 tokens in front of the probed sequence
PROMPT, RESPONSE = 24, 40
VOCAB = 101


def _logprobs(model, tokens: list[int], seq_lens: list[int], resp_start: int,
              dense: bool = False) -> torch.Tensor:
    """Log-probs of the last sequence's response tokens through the actor's hidden→log-prob pass."""
    from megatron_maspo.model.packed_attention import build_packed_seq_params
    from megatron_maspo.parallel.logprobs import vocab_parallel_logprobs_from_hidden
    from megatron_maspo.train.actor.forward import hidden_output, output_weight
    from megatron_maspo.train.actor.packing import block_causal_mask, cu_seqlens

    ids = torch.tensor(tokens).view(1, -1)
    pos = torch.cat([torch.arange(n) for n in seq_lens]).view(1, -1)
    rows = torch.arange(resp_start - 1, ids.shape[1] - 1)
    with torch.no_grad(), hidden_output([model]):
        if dense:
            hidden = model(ids, pos, block_causal_mask(seq_lens))
        else:
            hidden = model(ids, pos, None,
                           packed_seq_params=build_packed_seq_params(cu_seqlens(seq_lens)))
        lp, _ = vocab_parallel_logprobs_from_hidden(hidden[0].index_select(0, rows), output_weight(model),
                                                    ids[0, rows + 1], None, vocab_size=VOCAB)
    return lp.float()


def _worker(rank: int, world: int) -> dict:
    from megatron_maspo.model.provider import ModelBuildOptions, build_model_chunks
    from megatron_maspo.model.spec import ArchSpec
    from megatron_maspo.parallel.groups import init_parallel

    spec = ArchSpec(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                    num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=VOCAB,
                    max_position_embeddings=32768, rotary_base=1_000_000.0, add_qkv_bias=True,
                    tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(1, VOCAB, (PROMPT + RESPONSE,), generator=g).tolist()
    filler = torch.randint(1, VOCAB, (sum(FILLER),), generator=g).tolist()
    out = {}
    for name, bf16, backend in (("fp32", False, "packed_sdpa"), ("bf16", True, "packed_sdpa"),
                                ("bf16_dense", True, "dense_mask")):
        init_parallel(tp=1, pp=1, seed=5)
        torch.manual_seed(5)
        opts = ModelBuildOptions(bf16=bf16, attention_backend=backend)
        model = build_model_chunks(spec, opts, pp_rank=0)[0].eval()
        dense = backend == "dense_mask"
        alone = _logprobs(model, probe, [PROMPT + RESPONSE], PROMPT, dense)
        packed = _logprobs(model, filler + probe, FILLER + [PROMPT + RESPONSE], sum(FILLER) + PROMPT,
                           dense)
        out[name] = (alone, packed)
    return out


@pytest.mark.slow  # ~40-50 s on 2 cores; packed positions stay covered by tests/distributed/test_packed_attention.py
def test_same_sequence_at_offset_0_and_10k_gives_same_logprobs():
    res = run_workers(_worker, 1)[0]
    alone, packed = res["fp32"]
    assert alone.shape == (RESPONSE,) and torch.isfinite(alone).all()
    assert (packed - alone).abs().max() <= 1e-6
    b_alone, b_packed = res["bf16"]
    # bf16 really ran at lower precision (the comparison below is not fp32 in disguise) ...
    assert (b_alone - alone).abs().max() > 1e-4
    # ... and the sequence at offset 10,240 matches its unpacked bf16 run far inside bf16 rounding
    # (|lp| ~ 5: one bf16 ulp is 2^-6; measured: 0.0) ...
    diff = (b_packed - b_alone).abs()
    assert diff.max() <= 1e-4, diff.max()
    # ... while absolute rotary offsets (the dense-mask path) do not (measured: max 1.0e-3)
    d_alone, d_packed = res["bf16_dense"]
    assert (d_packed - d_alone).abs().max() > 1e-4
