"""Launching at scale: the capacity planner (pure maths), job options, and the NeMo-Run leaf module."""
