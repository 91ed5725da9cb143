"""HF <-> Megatron-Core conversion: declarative name tables shared by the offline converters and the
rollout weight sync (see docs/conversion.md)."""

from megatron_maspo.conversion.plan import hf_state_dict_keys

__all__ = ["hf_state_dict_keys"]
