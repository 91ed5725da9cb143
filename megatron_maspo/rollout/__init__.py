"""Rollout engines (built-in CPU engine, vLLM) and weight resharding from Megatron into them."""
