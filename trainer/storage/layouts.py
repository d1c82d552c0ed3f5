"""Every layout lorafleet keeps, as keys of the one store (trainer/storage/store.py): the one home of
where each kind of folder lives. Nothing else in the product composes these paths.

    runs/<name>-<registration>/checkpoints/step-NNNNNN/   a dataset run's checkpoint: run_state.json,
                                  trainer/ (the slot state) and adapter/ (the PEFT export), the two
                                  sub-folders committed by the trainer on their own (store.py S4)
    runs/<name>-<registration>/export/                    its final PEFT export (the last checkpoint's
                                  adapter/, linked)
    tinker/<tenant>/<run>/<kind>/<name>/                  a Tinker checkpoint (kind: weights = a slot
                                  state, sampler_weights and external_weights = PEFT folders); <run>
                                  is the model id with ':' -> '_'
    tinker/<tenant>/<run>/record/                          the Tinker training run's record (run.json)
    tinker/<tenant>/<run>/snapshots/s-<seq>/               a model's durable snapshot (a slot state) covering its
                                  operations up to <seq>
    swap/rank<r>/<key>/                                   an evicted slot's spill file, per trainer rank
                                  (benchmarks/bench_storage.py prices it; the trainer keeps its spill
                                  files on the node's disk: trainer/swap/swap_store.py says why)

Not here: the weight hand-off folders of engines.weight_transfer 'disk' are files of the state dir on
trainer rank 0's node, read by path (service/fleet/publishing.py U5, docs/ray-cluster.md).

Names are checked where they enter (adapter names, tenant names, Tinker ids); a key built here is a
relative path of those names, so a tenant can name nothing outside its own prefix.
"""

from __future__ import annotations

RUNS = "runs"
TINKER = "tinker"
SWAP = "swap"
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"
TRAINER_PART = "trainer"  # a run checkpoint's slot state
ADAPTER_PART = "adapter"  # a run checkpoint's PEFT export
TINKER_KINDS = ("weights", "sampler_weights", "external_weights")


def run_prefix(name: str, registration_id: str) -> str:
    """A dataset run's own prefix: unique per registration (a re-registered name gets a new one)."""
    return f"{RUNS}/{name}-{registration_id}"


def run_checkpoints(name: str, registration_id: str) -> str:
    return f"{run_prefix(name, registration_id)}/{CHECKPOINTS}"


def step_folder_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def run_checkpoint(name: str, registration_id: str, step: int) -> str:
    return f"{run_checkpoints(name, registration_id)}/{step_folder_name(step)}"


def run_export(name: str, registration_id: str) -> str:
    return f"{run_prefix(name, registration_id)}/export"


def tinker_tenant(tenant: str) -> str:
    """Everything of one tenant's Tinker face (its runs below)."""
    return f"{TINKER}/{tenant}"


def tinker_run(tenant: str, run_id: str) -> str:
    return f"{tinker_tenant(tenant)}/{run_id.replace(':', '_')}"


def tinker_checkpoint(tenant: str, run_id: str, kind: str, name: str) -> str:
    if kind not in TINKER_KINDS:
        raise ValueError(f"checkpoint kind {kind!r} unknown; kinds: {', '.join(TINKER_KINDS)}")
    return f"{tinker_run(tenant, run_id)}/{kind}/{name}"


def tinker_record(tenant: str, run_id: str) -> str:
    return f"{tinker_run(tenant, run_id)}/record"


def spill(rank: int, key: str) -> str:
    return f"{SWAP}/rank{rank}/{key}"


def tinker_snapshot(tenant: str, run_id: str, seq: int) -> str:
    """A Tinker model's durable snapshot covering its operations up to `seq` (service/tenants/tinker_durability.py)."""
    return f"{tinker_run(tenant, run_id)}/snapshots/s-{seq:012d}"
