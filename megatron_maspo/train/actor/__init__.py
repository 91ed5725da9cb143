"""The actor: the Megatron-Core policy, its optimizer, log-prob recompute, packing, offload and checkpoints.

Everything that turns a list of ``Sample`` into an optimizer step lives here; nothing here knows about
engines, graders or the loop.
"""
