"""Training: the Megatron actor step, checkpointing and the RL loop."""
