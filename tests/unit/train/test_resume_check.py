"""``--resume`` with a config its checkpoints cannot be loaded under: one line naming the first differing
fields, before any model is built (real config.yaml files written by ``save_config``, a real HF folder)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_maspo.config import save_config
from megatron_maspo.errors import ConfigError
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.train.process.resume_check import check_resume_config, config_differences


def _cfg(*sets: str):
    return resolve_config(None, None, list(sets))


def _with(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def test_same_or_reshardable_changes_pass(tmp_path):
    cfg = _cfg()
    save_config(cfg, tmp_path / "config.yaml")
    check_resume_config(tmp_path, cfg, None)
    # TP size, learning rate, sampling: the checkpoint follows (resharded, or the config wins)
    check_resume_config(tmp_path, _with(_with(cfg, "parallel", tp=2, world_size=2), "rollout", temperature=0.7), None)
    check_resume_config(tmp_path / "no_config_here", cfg, None)  # nothing saved: nothing to compare


@pytest.mark.parametrize(("section", "change", "named"), [
    ("model", {"tiny_hidden_size": 64}, "model.tiny_hidden_size 32 -> 64"),
    ("model", {"bf16": True}, "model.bf16 False -> True"),
    ("parallel", {"distributed_optimizer": True}, "parallel.distributed_optimizer False -> True"),
    ("loss", {"method": "grpo"}, "loss.method 'maspo' -> 'grpo'"),
])
def test_a_change_the_checkpoint_cannot_follow_is_one_line(tmp_path, section, change, named):
    cfg = _cfg("model.tiny_hidden_size=32")
    save_config(cfg, tmp_path / "config.yaml")
    with pytest.raises(ConfigError) as e:
        check_resume_config(tmp_path, _with(cfg, section, **change), None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--resume {tmp_path}: its checkpoints cannot be loaded "
                                              f"with this config: {named};"), msg


def test_several_differences_name_three_and_count_the_rest(tmp_path):
    cfg = _cfg("model.tiny_hidden_size=32", "model.tiny_num_layers=1")
    save_config(cfg, tmp_path / "config.yaml")
    new = _with(_with(cfg, "model", tiny_hidden_size=64, tiny_num_layers=2, bf16=True), "loss", method="grpo")
    with pytest.raises(ConfigError, match=r"model\.tiny_num_layers 1 -> 2, model\.tiny_hidden_size 32 -> 64, "
                                          r"model\.bf16 False -> True \(and 1 more\)"):
        check_resume_config(tmp_path, new, None)
    assert config_differences({"model": {}}, dataclasses.asdict(new)) == []  # an older config.yaml


def test_an_hf_folder_changed_under_the_same_path_is_named(tmp_path):
    from megatron_maspo.model.hf_config import arch_spec_from_hf
    from megatron_maspo.model.tiny_hf import make_tiny_hf_model

    model, _ = make_tiny_hf_model("llama", vocab_size=301)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / "maspo_arch.json").write_text(json.dumps(dataclasses.asdict(arch_spec_from_hf(str(hf)))))
    cfg = _with(_cfg(), "model", source=str(hf))
    save_config(cfg, tmp_path / "run" / "config.yaml")
    check_resume_config(tmp_path / "run", cfg, ckpt)
    hf_cfg = json.loads((hf / "config.json").read_text())
    hf_cfg["intermediate_size"] *= 2
    (hf / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=f"{hf}/config.json: ffn_hidden_size"):
        check_resume_config(tmp_path / "run", cfg, ckpt)

