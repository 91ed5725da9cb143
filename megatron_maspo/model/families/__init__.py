"""Model families, one declaration module each (``llama.py``, ``qwen2.py``, ...), collected by
``registry.py``; every family list in the package (``SUPPORTED_FAMILIES``, the conversion tables, the HF
model types, the tiny test configs, the planner presets) is a view of that registry. Torch-free."""
