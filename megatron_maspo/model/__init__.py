"""Model construction: architecture specs, HF config mapping and Megatron-Core GPT providers."""
