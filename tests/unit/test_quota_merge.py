"""A named tenant's quota is the default's, field by field, with only the fields its entry sets
over it (service/config/quotas.py Quotas.of): an entry that sets one field keeps every other limit
of the default (a merge that copied the entry's unset fields would wipe them)."""

from __future__ import annotations

import pytest

from service.config.quotas import Quotas

pytestmark = pytest.mark.unit


def test_an_entry_overrides_only_the_fields_it_sets():
    q = Quotas(default={"max_live_runs": 5, "max_queued_runs": 2, "token_share": 0.5, "priority": 3},
               tenants={"alice": {"priority": 7}, "bob": {"max_live_runs": 9, "token_share": None}})
    alice = q.of("alice")
    assert (alice.max_live_runs, alice.max_queued_runs, alice.token_share, alice.priority) == (5, 2, 0.5, 7)
    bob = q.of("bob")  # a field set to null on purpose lifts that limit; the others stay the default's
    assert (bob.max_live_runs, bob.max_queued_runs, bob.token_share, bob.priority) == (9, 2, None, 3)
    carol = q.of("carol")  # no entry: the default itself
    assert (carol.max_live_runs, carol.max_queued_runs, carol.token_share, carol.priority) == (5, 2, 0.5, 3)
    assert q.of(None) is None  # the admin has no quota
    assert (q.priority("alice"), q.token_share("alice"), q.source("alice"), q.source("carol")) == \
        (7, 0.5, "quotas.tenants.alice", "quotas.default")


def test_the_same_from_a_settings_file_shape():
    """As the settings file or LORAFLEET_QUOTAS spells it (JSON-like mapping through validation)."""
    q = Quotas.model_validate({"default": {"max_live_runs": 4}, "tenants": {"t1": {"max_queued_runs": 0}}})
    assert (q.of("t1").max_live_runs, q.of("t1").max_queued_runs) == (4, 0)
