"""Issue 14 F1/F2 end to end, on one running `lorafleet serve` (real CLI process, Ray, one SGLang CPU
engine, the Megatron-Bridge trainer, REST with a token):

  * an SFT tenant whose 16 rows are 100,000 characters each (tens of thousands of tokens against the
    tiny model's 512-token context) made one train call take 1,051 s while every other tenant waited;
  * an RL tenant whose prompts were all that long sat ACTIVE at step 0, holding its slot, while the
    engine refused about 5 requests a second.

Now both end FAILED with a reason that says why and free their slots; a tenant with some over-long
rows trains on the others (the skipped rows counted in its step metrics); a normal tenant steps
throughout.

Needs the runtime/loop hook of issue 14 (FleetRuntime.fatal_runs, called by the loop each round,
and the skip counts in the step metrics): without it the two unusable tenants never fail.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.service_world import rl, running_service, sft

pytestmark = pytest.mark.integration

LONG = "ab 12 " * 16_666  # 100,000 characters


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("limits"), tiny_world) as svc:
        yield svc


def wait_until(client, name, pred, what, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while True:
        ref = client.get(name)
        if pred(ref):
            return ref
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: {what} not reached in {timeout_s} s; now {ref['state']} step {ref['step']}: {ref['failure_reason']}")
        time.sleep(0.3)


def test_over_long_tenants_fail_with_a_reason_and_the_others_train(service, tiny_world):
    data = service.job_path.parent  # a data root of the served job (service_world.serve_job)
    (data / "long_sft.jsonl").write_text("".join(json.dumps({"prompt": f"{i} {LONG}", "completion": " ok"}) + "\n" for i in range(16)))
    (data / "long_rl.jsonl").write_text("".join(json.dumps({"prompt": f"{i} {LONG}", "label": "0123456789"}) + "\n" for i in range(16)))
    echo = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()[:12]]
    mixed = [dict(r, prompt=LONG) if i % 3 == 0 else r for i, r in enumerate(echo)]  # 4 of 12 rows too long
    (data / "mixed_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    with service.client() as c:
        c.register("ok-sft", sft(tiny_world))
        c.register("long-sft", {**sft(tiny_world), "data": {"path": str(data / "long_sft.jsonl")}})
        c.register("long-rl", {**rl(tiny_world), "data": {"path": str(data / "long_rl.jsonl")}})
        c.register("mixed-sft", {**sft(tiny_world), "data": {"path": str(data / "mixed_sft.jsonl")}, "prompts_per_step": 2})

        failed_sft = wait_until(c, "long-sft", lambda r: r["state"] == "FAILED", "FAILED")
        failed_rl = wait_until(c, "long-rl", lambda r: r["state"] == "FAILED", "FAILED")
        mixed = wait_until(c, "mixed-sft", lambda r: r["step"] >= 3, "3 steps")
        ok = wait_until(c, "ok-sft", lambda r: r["step"] >= 3, "3 steps")
        free = c.ready()["slots"]["free"]

    for ref, file in ((failed_sft, "long_sft.jsonl"), (failed_rl, "long_rl.jsonl")):
        assert ref["failure_reason"].startswith(f"no usable rows: all 16 rows of {file} are over a length limit"), ref["failure_reason"]
        assert ref["step"] == 0 and ref["slot"] is None
    assert "> max_prompt_tokens 4096" in failed_sft["failure_reason"] and "> max_prompt_tokens 500" in failed_rl["failure_reason"]
    assert free == 2  # the two failed tenants gave their slots back
    assert mixed["last_metrics"]["rows_skipped_too_long"] >= 1 and mixed["state"] == "ACTIVE"
    assert ok["last_metrics"]["rows_skipped_too_long"] == 0 and ok["state"] == "ACTIVE"
