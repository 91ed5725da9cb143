"""In-flight weight updates (``rollout.in_flight_updates``): new weights land between two decode steps of
the built-in engine; the response continues under them, each token keeps the version and log-prob it was
sampled with, and the rollout correction reads those per-token log-probs."""

from __future__ import annotations

import torch

from megatron_maspo.loss.config import LossConfig
from megatron_maspo.loss.params import RolloutCorrectionParams
from megatron_maspo.loss.rollout_correction import correction_factor
from megatron_maspo.model.tiny_hf import make_tiny_hf_model
from megatron_maspo.rollout.builtin_engine import BuiltinEngine
from megatron_maspo.rollout.types import SamplingParams
from megatron_maspo.train.rollouts.groups import PromptGroup, samples_from_groups
from megatron_maspo.train.rollouts.remote import version_spread

PROMPT = [5, 6, 7, 8, 9]
SWITCH = 3  # new weights land after the 3rd decode step: tokens 0-2 by W0, tokens 3.. by W1


def _full_logprobs(model, prompt, tokens):
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_a_response_spans_two_versions_and_each_token_keeps_its_logprob():
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}  # a tied lm_head is not sent
    engine = BuiltinEngine(model)
    engine.load_weights(w0.items())  # version 1
    g = torch.Generator().manual_seed(1)
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    calls = []

    def between_steps():
        calls.append(1)
        if len(calls) == SWITCH:
            engine.load_weights(w1.items())  # version 2, mid-response

    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
    comps = engine.generate([PROMPT], params, on_step=between_steps)[0]
    assert engine.policy_version == 2
    for c in comps:
        assert c.token_versions == [1] * SWITCH + [2] * (8 - SWITCH) and c.policy_version == 1
        lp = torch.tensor(c.logprobs)
        # tokens before the update: exactly W0's distribution over the prefix
        ref0 = _full_logprobs(_model_with(w0), PROMPT, c.token_ids)
        torch.testing.assert_close(lp[:SWITCH], ref0[:SWITCH], rtol=0, atol=1e-5)
        # tokens after it were sampled under W1 (over the KV cache W0 built): not W0's log-probs
        assert (lp[SWITCH:] - ref0[SWITCH:]).abs().max() > 1e-3
    spread = version_spread([PromptGroup(0, PROMPT, "1", comps, [0.0, 1.0], [False, True])])
    assert spread == {"rollout/version_spread_max": 1.0, "rollout/responses_spanning_versions": 1.0}

    # The trainer: one Sample per response, its rollout log-probs the per-token ones of both versions,
    # and the correction factor c_t = min(pi_old / pi_rollout(t), C) built from each token's own value.
    group = PromptGroup(0, PROMPT, "1", comps, [0.0, 1.0], [False, True])
    samples = samples_from_groups([group], LossConfig(tis_cap=2.0), overlong_filter=False, version_offset=0)
    p = RolloutCorrectionParams(mode="tis", cap=2.0)
    for s, c in zip(samples, comps):
        assert torch.equal(s.rollout_logprobs, torch.tensor(c.logprobs, dtype=torch.float32))
        old = _full_logprobs(_model_with(w1), PROMPT, c.token_ids)  # the trainer recomputes with W1
        factor, dropped = correction_factor(p, old, s.rollout_logprobs, torch.ones(8, dtype=torch.bool))
        torch.testing.assert_close(factor, torch.clamp(torch.exp(old - s.rollout_logprobs), max=2.0))
        assert not dropped.any()


def _model_with(weights):
    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    with torch.no_grad():
        for k, v in model.named_parameters():
            v.copy_(weights[k])
    return model.eval()


class _Blocking:
    """The built-in engine seen through a blocking ``generate`` only (how vLLM presents itself): the
    partial-rollout path is what runs, on a real model."""

    takes_weights_between_steps = False

    def __init__(self, engine: BuiltinEngine) -> None:
        self.inner = engine

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts, params, *, progress=None):
        return self.inner.generate(prompts, params, progress=progress)


def test_partial_rollouts_continue_unfinished_responses_under_new_weights():
    from megatron_maspo.rollout.partial import generate_partial

    model, _ = make_tiny_hf_model("qwen2", vocab_size=301, seed=0)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    engine = BuiltinEngine(model)
    engine.load_weights(w0.items())
    g = torch.Generator().manual_seed(1)
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    chunks = []

    def on_chunk():
        chunks.append(engine.policy_version)
        if len(chunks) == 1:
            engine.load_weights(w1.items())

    # token 7 stops some rows early: they finish in the first chunk, the others span both versions
    params = SamplingParams(n=3, temperature=1.0, max_tokens=9, seed=3, stop_token_ids=[7])
    out = generate_partial(_Blocking(engine), [PROMPT, [11, 12]], params, chunk_tokens=4, on_chunk=on_chunk)
    assert [len(cs) for cs in out] == [3, 3] and chunks == [1, 2]  # 3 chunks: 4 + 4 + 1 tokens
    spanning = 0
    for prompt, cs in zip([PROMPT, [11, 12]], out):
        for c in cs:
            n = len(c.token_ids)
            assert len(c.logprobs) == len(c.token_versions) == n <= 9
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 7 else "length")
            assert c.token_versions == [1] * min(n, 4) + [2] * max(0, n - 4)
            spanning += n > 4
            # the first chunk is W0's, the rest W1's over the whole prefix (recomputed, not cached)
            lp = torch.tensor(c.logprobs)
            torch.testing.assert_close(lp[:4], _full_logprobs(_model_with(w0), prompt, c.token_ids)[:4],
                                       rtol=0, atol=1e-5)
            if n > 4:
                torch.testing.assert_close(lp[4:], _full_logprobs(_model_with(w1), prompt, c.token_ids)[4:],
                                           rtol=0, atol=1e-5)
    assert spanning > 0
