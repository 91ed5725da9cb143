"""Elastic capacity requests (``rollout/supervision/elastic.py``, ``maspo engines``): the pool shape they
describe, the ids and owners they get, which are due at a boundary, and the command's refusals."""

from __future__ import annotations

import json

import pytest

from megatron_maspo.cli.main import main
from megatron_maspo.config import save_config
from megatron_maspo.recipes.registry import resolve_config
from megatron_maspo.rollout.supervision.elastic import (
    ControlDir,
    ElasticOwner,
    EngineRequest,
    default_owner,
    due,
    fleet_of,
    next_engine_id,
)


def _req(seq, verb, engine, owner, from_step=0):
    return EngineRequest(seq=seq, verb=verb, engine=engine, owner=owner, from_step=from_step)


def test_the_pool_shape_ids_and_owners_follow_the_requests():
    reqs = [_req(1, "add", 2, 0), _req(2, "add", 3, 1), _req(3, "drain", 0, 0)]
    assert fleet_of([], 2) == {0: 0, 1: 1}
    assert fleet_of(reqs, 2) == {1: 1, 2: 0, 3: 1}
    assert next_engine_id(reqs, 2) == 4
    assert next_engine_id([_req(1, "add", 2, 0), _req(2, "drain", 2, 0)], 2) == 3  # ids are never reused
    assert default_owner([], 2) == 0
    assert default_owner([_req(1, "add", 2, 0)], 2) == 1
    assert default_owner(reqs, 2) == 0  # owner 0 runs engine 2 only, owner 1 runs 1 and 3


def test_due_requests_are_the_owners_own_in_order_once():
    reqs = [_req(2, "add", 3, 0, from_step=5), _req(1, "add", 2, 0, from_step=3), _req(3, "add", 4, 1)]
    assert [r.seq for r in due(reqs, owner=0, step=2, done=set())] == []
    assert [r.seq for r in due(reqs, owner=0, step=5, done=set())] == [1, 2]
    assert [r.seq for r in due(reqs, owner=0, step=9, done={1})] == [2]
    assert [r.seq for r in due(reqs, owner=1, step=1, done=set())] == [3]


def test_bad_requests_are_refused_or_skipped(tmp_path, caplog):
    with pytest.raises(ValueError, match="verb"):
        EngineRequest(seq=1, verb="grow", engine=1, owner=0)
    with pytest.raises(ValueError, match=">= 0"):
        EngineRequest(seq=1, verb="add", engine=1, owner=0, from_step=-1)
    control = ControlDir(tmp_path)
    control.submit("add", engine=2, owner=0)
    (control.requests_dir / "0002-add-e9.json").write_text("{not json")  # an operator's typo
    assert [r.engine for r in control.requests()] == [2]
    assert "skipped" in caplog.text


class _Fleet:
    """The two calls an owner makes on its supervisor, recorded (the supervisor itself: test_engine_elastic)."""

    def __init__(self):
        self.engines, self.calls = [0], []

    def add_engine(self, engine, gpus=None):
        self.calls.append(("add", engine, gpus))
        self.engines.append(engine)

    def drain(self, engine):
        if self.engines == [engine]:
            raise ValueError(f"rollout engine {engine} is the last engine of its fleet: it cannot be drained")
        self.calls.append(("drain", engine))
        self.engines.remove(engine)


def test_an_owner_applies_its_due_requests_and_records_them(tmp_path):
    control = ControlDir(tmp_path)
    control.submit("add", engine=2, owner=0, from_step=3, gpus=(6, 7))
    control.submit("add", engine=3, owner=1)  # another owner's
    control.submit("drain", engine=0, owner=0, from_step=4)
    control.submit("drain", engine=2, owner=0, from_step=4)  # would leave none: refused, the job goes on
    fleet = _Fleet()
    owner = ElasticOwner(control, owner=0, supervisor=fleet)
    assert owner.at_boundary(2) == []
    assert owner.at_boundary(3) == ["rollout engine 2 joined owner 0's fleet before step 3"]
    lines = owner.at_boundary(5)
    assert lines[0] == "rollout engine 0 drained from owner 0's fleet before step 5"
    assert "0004-drain-e2.json refused before step 5: rollout engine 2 is the last engine" in lines[1]
    assert owner.at_boundary(6) == []
    assert fleet.calls == [("add", 2, (6, 7)), ("drain", 0)]
    out = control.outcomes()
    assert out[1]["step"] == 3 and out[1]["ok"] and out[3]["step"] == 5 and not out[4]["ok"]
    assert 2 not in out  # owner 1's request is owner 1's to apply


@pytest.fixture
def run_dir(tmp_path):
    cfg = resolve_config(None, None, ["rollout.placement=disaggregated", "rollout.engine_ranks=2",
                                      "parallel.world_size=3", "rollout.supervise_engines=true"])
    save_config(cfg, tmp_path / "config.yaml")
    return tmp_path


def test_the_command_writes_requests_and_refuses_what_cannot_be(run_dir, capsys):
    assert main(["engines", "add", str(run_dir), "--from-step", "3"]) == 0
    assert main(["engines", "add", str(run_dir), "--gpus", "6,7"]) == 0
    first, second = ControlDir(run_dir).requests()
    assert (first.engine, first.owner, first.from_step) == (2, 0, 3)
    assert (second.engine, second.owner, second.gpus) == (3, 1, (6, 7))  # to the owner with fewer
    assert main(["engines", "drain", str(run_dir), "--engine", "0"]) == 0
    assert main(["engines", "drain", str(run_dir), "--engine", "2"]) == 2  # owner 0's last one now
    assert main(["engines", "drain", str(run_dir), "--engine", "7"]) == 2
    assert main(["engines", "add", str(run_dir), "--owner", "5"]) == 2
    err = capsys.readouterr().err
    assert "engine 2 is the last engine of owner 0" in err and "engine 7 is not in the pool" in err
    capsys.readouterr()
    assert main(["engines", "list", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "0001-add-e2.json: add engine 2 (owner 0, from step 3): pending" in out
    assert "pool after every request: 3 engines [1, 2, 3]" in out
    raw = json.loads((ControlDir(run_dir).requests_dir / "0003-drain-e0.json").read_text())
    assert raw["verb"] == "drain" and raw["owner"] == 0


def test_the_command_refuses_a_run_without_supervised_engines(tmp_path, capsys):
    save_config(resolve_config(None, None, []), tmp_path / "config.yaml")
    assert main(["engines", "add", str(tmp_path)]) == 2
    assert "rollout.supervise_engines=true" in capsys.readouterr().err
    assert main(["engines", "add", str(tmp_path / "nowhere")]) == 2
