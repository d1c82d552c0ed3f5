"""trainer/export/copy_feeder.py CopyFeeder: rows copied in submission order from one thread, each row's
CopyDone set once its copy ended, a failed job's waiters told its error, later jobs unaffected.

Real threads and tensors on the CPU (the feeder's CUDA branch issues the same copies on the copy
stream; the GPU benchmark's background_equals_sync checks its folders against the synchronous export)."""

from __future__ import annotations

import pytest
import torch

from trainer.export.copy_feeder import CopyFeeder

pytestmark = pytest.mark.unit


def test_rows_arrive_in_order_and_each_is_done_when_copied():
    feeder = CopyFeeder(stream=None)
    jobs = []
    for r in range(5):
        bodies = torch.arange(4 * 8, dtype=torch.float32).view(4, 8) + 100 * r
        hosts = [torch.empty(8) for _ in range(4)]
        jobs.append((bodies.clone(), hosts, feeder.submit(bodies, hosts)))
    for bodies, hosts, done in jobs:
        for i, d in enumerate(done):
            d.synchronize()
            assert torch.equal(hosts[i], bodies[i])


def test_one_shared_host_range_holds_the_last_job_written_to_it():
    """Two jobs into the same host tensor (an arena range a superseded snapshot gave back): the
    later job's copy runs after the earlier one's, so the range ends with the later data."""
    feeder = CopyFeeder(stream=None)
    shared = torch.empty(16)
    first = feeder.submit(torch.full((1, 16), 1.0), [shared])
    second = feeder.submit(torch.full((1, 16), 2.0), [shared])
    second[0].synchronize()
    assert first[0].query() and bool((shared == 2.0).all())


def test_a_failed_job_tells_its_waiters_and_the_next_job_runs():
    feeder = CopyFeeder(stream=None)
    bad = feeder.submit(torch.zeros(2, 8), [torch.empty(8), torch.empty(3)])  # the second row does not fit
    good_hosts = [torch.empty(8)]
    good = feeder.submit(torch.ones(1, 8), good_hosts)
    bad[0].synchronize()
    with pytest.raises(RuntimeError):
        bad[1].synchronize()
    good[0].synchronize()
    assert bool((good_hosts[0] == 1).all())

