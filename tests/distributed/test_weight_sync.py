"""Weight sync on CPU gloo: a tiny Megatron GPT trained one SGD step at TP=2 and at PP=2 is resharded into
the built-in engine, whose tensors then equal the HF export bitwise and whose greedy tokens and log-probs
(greedy and T=0.8 sampling) equal the Megatron model's. The sync runs with buckets smaller than the
embedding, so that tensor is split across buckets and reassembled by the engine; a corrupted bucket raises
clearly on the sender without deadlocking the other ranks."""

from __future__ import annotations

import pytest
import torch

from megatron_maspo.model.spec import ArchSpec
from tests.distributed._launch import run_workers

SPEC = ArchSpec(family="qwen2", num_layers=2, hidden_size=128, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, kv_channels=32, vocab_size=251, max_position_embeddings=64,
                add_qkv_bias=True, tie_word_embeddings=True)
PROMPTS = [[5, 17, 33, 2, 9, 100], [250, 1, 42, 42, 7, 3], [60, 61, 62, 63, 64, 65]]
MAX_TOKENS, TEMP, LR = 6, 0.8, 0.05
BUCKET = 100_000  # bytes: < the 251x128 fp32 embedding (128,512 B): it is split over two buckets


def train_one_step(tp: int, pp: int):
    """Build (name-seeded init), run Megatron's schedule on 2 micro-batches, apply one SGD step."""
    import torch.distributed as dist

    from tests.distributed._gpt_helpers import build, make_batches, run_schedule

    groups, chunks = build(SPEC, tp, pp, divisible_by=64)
    run_schedule(chunks, make_batches(SPEC.vocab_size, 2, 2, 8), 8, 2)
    if groups.pp > 1 and (groups.is_first_stage or groups.is_last_stage):
        dist.all_reduce(chunks[0].shared_embedding_or_output_weight().grad, group=groups.embd_group)
    with torch.no_grad():
        for m in chunks:
            for p in m.parameters():
                p.sub_(LR * p.grad)
    return groups, chunks


def megatron_logprobs(chunks, groups, seqs: list[list[int]], temperature: float):
    """(log-probs of seqs[:, 1:], argmax tokens), both [B, L-1], full vocab at ``temperature``; on the
    last stage, else None."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.tensor(seqs)
    b, s = tokens.shape
    store = {}

    def forward_step(it, model):
        batch = next(it)
        out = model(batch, torch.arange(s).expand(b, s).contiguous(), None)

        def loss_func(o):
            store["logits"] = o.detach()
            return o.sum() * 0, torch.tensor(1), {}
        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                model=chunks[0], num_microbatches=1, seq_length=s, micro_batch_size=b,
                                forward_only=True)
    if not groups.is_last_stage:
        return None
    logits = store["logits"]  # [B, S, V_pad / tp]
    if groups.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(groups.tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
        logits = torch.cat(parts, dim=-1)
    lp = torch.log_softmax(logits[..., :SPEC.vocab_size].float() / temperature, dim=-1)
    return lp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1), lp[:, :-1].argmax(-1)


class _Corrupting:
    """Wraps an engine and flips one byte of bucket ``which`` in transit."""

    def __init__(self, engine, which: int):
        self.engine, self.which = engine, which
        self.policy_version = 0

    def bucket_pool(self, bucket_bytes):
        return None

    def load_buckets(self, buckets, verify=True):
        def flip(bs):
            for bk in bs:
                if bk.index == self.which:
                    bk.buffer[7] ^= 0xFF
                yield bk
        self.engine.load_buckets(flip(buckets), verify=verify)


def _worker(rank: int, world: int, tp: int, pp: int):
    import torch.distributed as dist

    from megatron_maspo.conversion.megatron_to_hf import export_hf_weights
    from megatron_maspo.model.hf_config import hf_config_dict
    from megatron_maspo.rollout.builtin_engine import BuiltinEngine
    from megatron_maspo.rollout.types import SamplingParams
    from megatron_maspo.rollout.weight_sync import sync_weights

    groups, chunks = train_one_step(tp, pp)
    engine = BuiltinEngine.from_hf_config(hf_config_dict(SPEC)) if rank == 0 else None
    res: dict = {}
    # 1) failures first: each raises on the sender only, after draining the export (no deadlock).
    for name, kwargs, eng in (("corrupt", {"bucket_bytes": BUCKET}, engine and _Corrupting(engine, 1)),):
        try:
            sync_weights(chunks, SPEC, groups, eng, **kwargs)
            res[name] = None
        except ValueError as e:
            res[name] = str(e)
    # 2) the real sync, then an independent export to compare against bitwise.
    stats = sync_weights(chunks, SPEC, groups, engine, bucket_bytes=BUCKET)
    exported = {n: t for n, t in export_hf_weights(chunks, SPEC, groups)}
    outs = [None, None]
    if rank == 0:
        params = dict(engine.model.named_parameters())
        res["bitwise"] = sorted(n for n, t in exported.items() if not torch.equal(params[n], t))
        res["names"] = sorted(set(params) ^ set(exported))
        res["stats"] = (stats.num_tensors, stats.num_buckets, engine.policy_version)
        outs = [engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)),
                engine.generate(PROMPTS, SamplingParams(n=2, temperature=TEMP, max_tokens=MAX_TOKENS, seed=11))]
    dist.broadcast_object_list(outs, src=0)
    greedy, sampled = outs
    for key, comps, temp in (("greedy", greedy, 1.0), ("sampled", sampled, TEMP)):
        flat = [c for per_prompt in comps for c in per_prompt]
        seqs = [p + c.token_ids for p, per in zip(PROMPTS, comps) for c in per]
        out = megatron_logprobs(chunks, groups, seqs, temp)
        if out is not None:
            n0 = len(PROMPTS[0])
            res[key] = (torch.tensor([c.logprobs for c in flat]), out[0][:, n0 - 1:],
                        torch.tensor([c.token_ids for c in flat]), out[1][:, n0 - 1:])
    res["is_last"] = groups.is_last_stage
    return res


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_sync_into_builtin_engine_matches_megatron(tp, pp):
    results = run_workers(_worker, 2, tp, pp)
    r0 = results[0]
    last = next(r for r in results if r["is_last"])
    assert r0["corrupt"] and "bucket 1 is corrupted" in r0["corrupt"]
    assert r0["names"] == [] and r0["bitwise"] == []
    n_tensors, n_buckets, version = r0["stats"]
    assert n_tensors == 1 + SPEC.num_layers * 12 + 1 and n_buckets > 2 and version == 1
    for key in ("greedy", "sampled"):
        engine_lp, mcore_lp, tokens, _ = last[key]
        assert tokens.shape == (len(PROMPTS) * (1 if key == "greedy" else 2), MAX_TOKENS)
        torch.testing.assert_close(engine_lp, mcore_lp, rtol=0, atol=2e-5)
    _, _, tokens, mcore_argmax = last["greedy"]
    assert torch.equal(tokens, mcore_argmax), "engine greedy tokens differ from Megatron's argmax"
    sampled = last["sampled"][2]
    assert not torch.equal(sampled[0::2], sampled[1::2]), "n=2 samples per prompt came out identical"
