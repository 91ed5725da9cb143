"""megatron_maspo: RL fine-tuning of LLMs on Megatron-Core with MASPO and the GRPO family.

Importing this package is cheap: it pulls in neither megatron-core, vLLM, Transformer Engine nor
NeMo-Run. Sub-packages import their heavy dependencies only in leaf modules.
"""

__version__ = "0.1.0"
