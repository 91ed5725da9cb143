"""The trainer's side of rollouts: this rank's engine shard, grading, prompt groups, the staleness queue.

The engines themselves (built-in, vLLM) and the weight transport live in :mod:`megatron_maspo.rollout`;
this package decides which prompts each engine samples, grades them where they were generated, and hands
the loop one :class:`~megatron_maspo.train.rollouts.staleness.RolloutBatch` per step.
"""
