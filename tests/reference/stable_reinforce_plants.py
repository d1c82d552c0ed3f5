"""Plant bugs in stable_reinforce's product code and watch its tests catch each one.

    PYTHONPATH=. .venv/bin/python -m tests.reference.stable_reinforce_plants          # every plant
    PYTHONPATH=. .venv/bin/python -m tests.reference.stable_reinforce_plants no_cap   # one

Each plant rewrites one line of a product file, runs the tests named for it, and puts the file back
exactly as it was (also when interrupted); a plant the tests do not catch is reported as MISSED and
the run exits non-zero. The files are read first: a line that is not there exactly once stops the run
before anything changes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOSS = "trainer/losses/stable_reinforce.py"
REFERENCE_TESTS = ["tests/reference/test_stable_reinforce.py"]
CHECKS = "api/tinker/stability.py"
RECORDS = "service/registry/sampling_records.py"
PROVENANCE_TESTS = ["tests/unit/test_stability_provenance.py"]
ROUTING = "api/tinker/sampler_engines.py"
SAMPLING = "api/tinker/sampling.py"
ROUTING_TESTS = ["tests/unit/test_sampler_routing.py"]
# name -> (file, line as it is, planted line, tests that must fail)
PLANTS = {
    "no_cap": (LOSS, 'weight = torch.clamp(ratio, max=cfg["ratio_cap"])', "weight = ratio", REFERENCE_TESTS),
    "product_not_geometric_mean": (LOSS, "log_mean = sums / counts.clamp(min=1.0)", "log_mean = sums", REFERENCE_TESTS),
    "kl_without_half": (LOSS, '0.5 * cfg["kl_coeff"] * (lp - q) ** 2', 'cfg["kl_coeff"] * (lp - q) ** 2', REFERENCE_TESTS),
    "gradient_through_weight": (LOSS, "delta = lp.detach() - q\n    ratio", "delta = lp - q\n    ratio", REFERENCE_TESTS),
    "mask_ignored": (LOSS, "loss = torch.where(keep, per_token,", "loss = torch.where(groups > 0, per_token,", REFERENCE_TESTS),
    "mask_bounds_exclusive": (LOSS, "kept = (log_mean >= lo) & (log_mean <= math.log(high))",
                              "kept = (log_mean > lo) & (log_mean < math.log(high))", REFERENCE_TESTS),
    "default_cap": (LOSS, 'DEFAULTS = {"ratio_cap": 2.0,', 'DEFAULTS = {"ratio_cap": 2.5,', REFERENCE_TESTS),
    # the server side: provenance checked against the records (api/tinker/stability.py, the records)
    "client_logprobs_kept": (CHECKS, '{**datum.inputs, "logprobs": q, "sampled_sequence": groups}',
                             '{"logprobs": q, **datum.inputs, "sampled_sequence": groups}', PROVENANCE_TESTS),
    "prompt_advantages_allowed": (CHECKS, "            if len(nonzero):", "            if False and len(nonzero):", PROVENANCE_TESTS),
    "sampled_targets_unchecked": (CHECKS, "if tuple(targets[at:end].tolist()) != tuple(want):", "if False:", PROVENANCE_TESTS),
    "model_input_unchecked": (CHECKS, "if tuple(datum.tokens[at: at + span.length]) != tuple(want):", "if False:", PROVENANCE_TESTS),
    "records_used_on_refusal": (CHECKS, "found = records.sampled_sequences(tenant, ids, touch=False)",
                                "found = records.sampled_sequences(tenant, ids, touch=True)", PROVENANCE_TESTS),
    "any_tenants_records": (RECORDS, "AND r.tenant = ? AND s.used_at >= ?", "AND ? IS NOT NULL AND s.used_at >= ?", PROVENANCE_TESTS),
    "records_never_expire": (RECORDS, "AND r.tenant = ? AND s.used_at >= ?", "AND r.tenant = ? AND s.used_at + 1e12 >= ?", PROVENANCE_TESTS),
    # sampling over the engines (api/tinker/sampler_engines.py, api/tinker/sampling.py)
    "no_retry_on_a_lost_engine": (SAMPLING, "            if not _engine_lost(error):\n", "            if True:\n", ROUTING_TESTS),
    "sticky_ignored": (ROUTING, "e = next((x for x in holding if x.key == sticky), None) or min(holding, key=lambda x: x.load)",
                       "e = min(holding, key=lambda x: x.load)", ROUTING_TESTS),
    "room_only_on_the_least_loaded": (ROUTING, "        for e in up:  # R2", "        for e in [min(up, key=lambda x: x.load)]:  # R2",
                                      ROUTING_TESTS),
    "engine_list_read_once": (ROUTING, "if not force and loop.time() - self._refreshed_at < self.refresh_s:",
                              "if self._refreshed_at > 0:", ROUTING_TESTS),
    "busy_adapter_unloaded": (ROUTING, "lambda n, e=e: e.in_use[n] > 0", "lambda n, e=e: False", ROUTING_TESTS),
}


def run_plant(name: str) -> bool:
    """True when the plant's tests fail (caught)."""
    rel, old, new, tests = PLANTS[name]
    path = ROOT / rel
    original = path.read_text()
    if original.count(old) != 1:
        raise SystemExit(f"{name}: {rel} does not hold the line to plant exactly once")
    try:
        path.write_text(original.replace(old, new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                              capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    finally:
        path.write_text(original)
    summary = (proc.stdout.strip().splitlines() or ["?"])[-1]
    print(f"{name}: {'caught' if proc.returncode != 0 else 'MISSED'} ({summary})")
    return proc.returncode != 0


if __name__ == "__main__":
    names = sys.argv[1:] or list(PLANTS)
    missed = [n for n in names if not run_plant(n)]
    sys.exit(1 if missed else 0)
