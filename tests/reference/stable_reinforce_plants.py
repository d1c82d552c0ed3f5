"""Plant bugs in stable_reinforce's product code and in the Tinker sampler, and watch their tests
catch each one (the planting, test run and restore: tests/unit/expert_kernel_mutations.py ``run``).

    PYTHONPATH=. .venv/bin/python -m tests.reference.stable_reinforce_plants          # every plant
    PYTHONPATH=. .venv/bin/python -m tests.reference.stable_reinforce_plants no_cap   # one

Each plant rewrites one exact piece of a product file, runs the tests of its group, and puts the
file back as it was (also when interrupted); one that no test catches is printed as SURVIVED and the
exit status is 1.
"""

from __future__ import annotations

import sys

from tests.unit.expert_kernel_mutations import run

LOSS = "trainer/losses/stable_reinforce.py"
CHECKS = "api/tinker/sampling/stability.py"
RECORDS = "service/registry/sampling_records.py"
ROUTING = "api/tinker/sampling/engines.py"
SAMPLING = "api/tinker/sampling/sampler.py"

# tests -> {name: (file, exact text, replacement, what the bug is)}
GROUPS = {
    ("tests/reference/test_stable_reinforce.py",): {
        "no_cap": (LOSS, 'weight = torch.clamp(ratio, max=cfg["ratio_cap"])', "weight = ratio", "the token weight not truncated"),
        "product_not_geometric_mean": (LOSS, "log_mean = sums / counts.clamp(min=1.0)", "log_mean = sums",
                                       "the sequence ratio a product, not a geometric mean"),
        "kl_without_half": (LOSS, '0.5 * cfg["kl_coeff"] * (lp - q) ** 2', 'cfg["kl_coeff"] * (lp - q) ** 2', "the KL term doubled"),
        "gradient_through_weight": (LOSS, "delta = lp.detach() - q\n    ratio", "delta = lp - q\n    ratio",
                                    "the weight differentiated"),
        "mask_ignored": (LOSS, "loss = torch.where(keep, per_token,", "loss = torch.where(groups > 0, per_token,",
                         "masked sequences still trained"),
        "mask_bounds_exclusive": (LOSS, "kept = (log_mean >= lo) & (log_mean <= math.log(high))",
                                  "kept = (log_mean > lo) & (log_mean < math.log(high))", "the bounds exclusive"),
        "default_cap": (LOSS, 'DEFAULTS = {"ratio_cap": 2.0,', 'DEFAULTS = {"ratio_cap": 2.5,', "another default cap"),
    },
    ("tests/unit/test_stability_provenance.py",): {
        "client_logprobs_kept": (CHECKS, '{**datum.inputs, "logprobs": q, "sampled_sequence": groups}',
                                 '{"logprobs": q, **datum.inputs, "sampled_sequence": groups}', "the client's logprobs win"),
        "prompt_advantages_allowed": (CHECKS, "            if len(nonzero):", "            if False and len(nonzero):",
                                      "advantages on prompt positions accepted"),
        "sampled_targets_unchecked": (CHECKS, "if tuple(targets[at:end].tolist()) != tuple(want):", "if False:",
                                      "sampled targets not compared with the record"),
        "model_input_unchecked": (CHECKS, "if tuple(datum.tokens[at: at + span.length]) != tuple(want):", "if False:",
                                  "model_input not compared with the record"),
        "records_used_on_refusal": (CHECKS, "found = records.sampled_sequences(tenant, ids, touch=False)",
                                    "found = records.sampled_sequences(tenant, ids, touch=True)", "a refused call uses records"),
        "any_tenants_records": (RECORDS, "AND r.tenant = ? AND s.used_at >= ?", "AND ? IS NOT NULL AND s.used_at >= ?",
                                "another tenant's records readable"),
        "records_never_expire": (RECORDS, "AND r.tenant = ? AND s.used_at >= ?", "AND r.tenant = ? AND s.used_at + 1e12 >= ?",
                                 "expired records readable"),
    },
    ("tests/unit/test_sampler_routing.py",): {
        "no_retry_on_a_lost_engine": (SAMPLING, "            if not _engine_lost(error):\n", "            if True:\n",
                                      "an engine lost mid-request fails the request"),
        "sticky_ignored": (ROUTING, "e = next((x for x in holding if x.key == sticky), None) or min(holding, key=lambda x: x.load)",
                           "e = min(holding, key=lambda x: x.load)", "a session not kept on its engine"),
        "room_only_on_the_least_loaded": (ROUTING, "        for e in up:  # R2", "        for e in [min(up, key=lambda x: x.load)]:  # R2",
                                          "a request waits for room on the least loaded engine while another has room"),
        "engine_list_read_once": (ROUTING, "if not force and loop.time() - self._refreshed_at < self.refresh_s:",
                                  "if self._refreshed_at > 0:", "the fleet's list read once (a cached URL)"),
        "busy_adapter_unloaded": (ROUTING, "lambda n, e=e: e.in_use[n] > 0", "lambda n, e=e: False", "an adapter in use unloaded"),
    },
}


def main(argv: list[str]) -> int:
    known = {name for plants in GROUPS.values() for name in plants}
    unknown = [n for n in argv if n not in known]
    if unknown:
        raise SystemExit(f"unknown plants {unknown}: choose from {', '.join(sorted(known))}")
    caught = [run(name, plants, list(tests)) for tests, plants in GROUPS.items() for name in plants if not argv or name in argv]
    return 0 if all(caught) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
