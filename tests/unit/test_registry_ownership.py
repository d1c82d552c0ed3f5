"""Tenant ownership in the registry (its I8; issue 14, F5), on a real SQLite file:

* every read a tenant makes is filtered by owner; another tenant's run answers NotFound with
  exactly the message of a run that does not exist; the admin (None) sees every run;
* names are global: a live run's name is refused to another tenant without saying whose or its
  state; after it ends, anyone registers the name again and every earlier run stays reachable;
* a registry file written before owners existed opens, and its runs are the admin's;
* what a tenant may start from (service/control/ownership.py): data roots and its own runs' folders.
"""

from __future__ import annotations

import sqlite3

import pytest

from service.config.adapter import AdapterConfig
from service.errors import BadValue, Conflict, NotFound
from service.control.ownership import check_tenant_start_paths, may_start_from
from service.registry.registry import AdapterState as S
from service.registry.registry import Registry

pytestmark = pytest.mark.unit

CONFIG = AdapterConfig(data={"path": "x.jsonl"}, reward={"name": "target_share"}, num_step=5)


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "registry.sqlite3", num_slots=4)
    yield r
    r.close()


def finish(reg: Registry, registration_id: str) -> None:
    """The reconcile's part: a retired run ends COMPLETED."""
    for state in (S.RETIRING, S.CLEANUP, S.COMPLETED):
        reg.transition(registration_id, state)


def not_found(call, *args, **kwargs) -> str:
    with pytest.raises(NotFound) as e:
        call(*args, **kwargs)
    return e.value.message


def test_a_tenant_sees_only_its_own_runs_and_another_is_exactly_a_missing_one(reg):
    a = reg.register("a-run", CONFIG, total_steps=5, owner="alice")
    b = reg.register("b-run", CONFIG, total_steps=5, owner="bob")
    adm = reg.register("adm-run", CONFIG, total_steps=5)
    assert (a.owner, b.owner, adm.owner) == ("alice", "bob", None)

    assert [r.name for r in reg.list(tenant="alice")] == ["a-run"]
    assert [r.name for r in reg.list(tenant="bob")] == ["b-run"]
    assert [r.name for r in reg.list(tenant="carol")] == []
    assert [r.name for r in reg.list()] == ["a-run", "b-run", "adm-run"]  # the admin: every run
    assert [r.name for r in reg.list(S.PENDING, tenant="alice")] == ["a-run"]

    # another tenant's name, run id, runs and metrics: the very message of one that does not exist
    for call in (reg.get, reg.runs, reg.metrics):
        assert not_found(call, "b-run", tenant="alice") == not_found(call, "no-such", tenant="alice").replace("no-such", "b-run")
        assert not_found(call, "adm-run", tenant="alice") == not_found(call, "no-such").replace("no-such", "adm-run")
    for call in (reg.get_run, reg.run_metrics):
        assert not_found(call, b.registration_id, tenant="alice") == \
            not_found(call, "0" * 32, tenant="alice").replace("0" * 32, b.registration_id)
    assert reg.get("b-run").registration_id == b.registration_id  # the admin reads it
    assert reg.get_run(b.registration_id, tenant="bob").owner == "bob"
    assert [r.name for r in reg.owned_runs("bob")] == ["b-run"]


def test_names_are_global_and_a_reregistered_name_keeps_its_earlier_runs(reg):
    first = reg.register("x", CONFIG, total_steps=5, owner="alice")
    reg.mark_prepared(first.registration_id, weight_version=reg.next_version())
    reg.record_step(first.registration_id, step=1, samples=4, metrics={"loss": 2.0})

    with pytest.raises(Conflict) as e:  # bob: taken, not whose nor in which state
        reg.register("x", CONFIG, total_steps=5, owner="bob")
    assert "is taken by a live run" in e.value.message
    assert "alice" not in e.value.message and "ACTIVE" not in e.value.message
    with pytest.raises(Conflict, match=r"in use by a live run \(state ACTIVE\)"):  # its owner and the admin: the details
        reg.register("x", CONFIG, total_steps=5, owner="alice")
    with pytest.raises(Conflict, match=r"in use by a live run \(state ACTIVE\)"):
        reg.register("x", CONFIG, total_steps=5)

    finish(reg, first.registration_id)
    second = reg.register("x", CONFIG, total_steps=5, owner="alice")
    finish(reg, second.registration_id)
    third_after = reg.register("x", CONFIG, total_steps=5, owner="bob")  # an ended name is free for anyone

    assert [(r.registration_id, r.state) for r in reg.runs("x", tenant="alice")] == [
        (first.registration_id, S.COMPLETED), (second.registration_id, S.COMPLETED)]
    assert [r.registration_id for r in reg.runs("x", tenant="bob")] == [third_after.registration_id]
    assert [r.registration_id for r in reg.runs("x")] == [first.registration_id, second.registration_id, third_after.registration_id]
    # "the adapter x" is the caller's newest run of it
    assert reg.get("x", tenant="alice").registration_id == second.registration_id
    assert reg.get("x", tenant="bob").registration_id == third_after.registration_id
    assert reg.get("x").registration_id == third_after.registration_id
    assert [r.registration_id for r in reg.list(tenant="alice")] == [second.registration_id]
    # the first run's record and series stay reachable by its id
    old = reg.get_run(first.registration_id, tenant="alice")
    assert (old.state, old.step, old.samples_trained) == (S.COMPLETED, 1, 4)
    name, steps = reg.run_metrics(first.registration_id, tenant="alice")
    assert name == "x" and [(s.step, s.metrics) for s in steps] == [(1, {"loss": 2.0})]
    assert reg.metrics("x", tenant="alice") == (second.registration_id, [])


def test_a_registry_written_before_owners_opens_with_its_runs_owned_by_the_admin(tmp_path):
    path = tmp_path / "registry.sqlite3"
    reg = Registry(path, num_slots=2)
    old = reg.register("legacy", CONFIG, total_steps=5)
    reg.close()
    # make the file exactly what the previous schema wrote: no owner column, no owner index
    with sqlite3.connect(path) as db:
        db.execute("DROP INDEX runs_by_owner")
        db.execute("DROP INDEX runs_by_owner_state")  # issue 26's indexes came after owners
        db.execute("ALTER TABLE runs DROP COLUMN owner")
        assert "owner" not in {r[1] for r in db.execute("PRAGMA table_info(runs)")}
    db.close()

    reg = Registry(path, num_slots=2)
    try:
        ref = reg.get("legacy")
        assert (ref.registration_id, ref.owner, ref.state) == (old.registration_id, None, S.PENDING)
        assert reg.list(tenant="alice") == [] and [r.name for r in reg.list()] == ["legacy"]
        assert "no adapter named 'legacy'" in not_found(reg.get, "legacy", tenant="alice")
        assert reg.register("new", CONFIG, total_steps=5, owner="alice").owner == "alice"
    finally:
        reg.close()
    reg = Registry(path, num_slots=2)  # and opens again (the migration ran once)
    try:
        assert [(r.name, r.owner) for r in reg.list()] == [("legacy", None), ("new", "alice")]
    finally:
        reg.close()


def test_a_tenant_starts_only_from_data_roots_and_its_own_runs(tmp_path):
    data, state = tmp_path / "data", tmp_path / "state"
    own, other = state / "runs" / "mine-1", state / "runs" / "theirs-2"
    shared_in_state = state / "shared"
    for d in (data / "peft", own / "checkpoints" / "step_2", other / "checkpoints" / "step_2", shared_in_state / "peft",
              state / "tinker" / "bob"):
        d.mkdir(parents=True)
    (data / "to_other").symlink_to(other / "checkpoints" / "step_2")

    def ok(path, roots=(data,)):
        return may_start_from(path, state_dir=state, data_roots=list(roots), own_dirs=[own])

    assert ok(data / "peft")
    assert ok(own / "checkpoints" / "step_2")
    assert not ok(other / "checkpoints" / "step_2")
    assert not ok(state / "tinker" / "bob")
    assert not ok(state)
    assert not ok(data / "to_other")  # a symlink in a data root into another run's folder
    assert ok(shared_in_state / "peft", roots=(data, shared_in_state))  # a data root the operator put in the state dir
    # a data root that holds the state dir does not open the other runs' folders
    assert not ok(other / "checkpoints" / "step_2", roots=(tmp_path,))
    assert ok(tmp_path / "data" / "peft", roots=(tmp_path,))

    cfg = CONFIG.model_copy(update={"resume_from": str(other / "checkpoints" / "step_2")})
    with pytest.raises(BadValue) as e:
        check_tenant_start_paths(cfg, state_dir=state, data_roots=[data], own_dirs=[own])
    assert e.value.field == "config.resume_from" and "is not yours to start from" in e.value.message
    assert "shared data roots or one of its own runs' checkpoints" in e.value.message
    check_tenant_start_paths(cfg.model_copy(update={"resume_from": str(own / "checkpoints" / "step_2")}),
                             state_dir=state, data_roots=[data], own_dirs=[own])


def test_a_refused_slot_lease_names_no_holder(reg):
    """The lease refusal reaches a tenant's Tinker future: it must not name other tenants' runs or models."""
    run = reg.register("bob-secret-run", CONFIG, total_steps=5, owner="bob")
    assert run.slot is not None  # a free slot is bound at registration
    for i in range(3):  # the other three slots: bob's Tinker models
        reg.lease_slot(f"bob-model-{i}", "bob")
    with pytest.raises(Conflict) as e:
        reg.lease_slot("alice-model", "alice")
    assert "no free trainer slot" in e.value.message
    assert "bob" not in e.value.message, e.value.message
