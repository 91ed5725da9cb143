"""Observability: metric sinks (JSONL, TensorBoard, W&B), the console line, progress bars, plots, memory."""
