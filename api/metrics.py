"""GET /metrics: the controller's snapshot as Prometheus text.

A fresh CollectorRegistry per scrape (no process-global metric state): the
values are read from the registry and the runtime at scrape time, so they are
never stale and two apps in one process never share series.

Bounded cardinality (issue 26): fleet-wide gauges are counts (adapters by state, live runs by
residency, swap tiers); per-adapter series (label `adapter`) exist only for the adapters of the
snapshot, which settings.metrics_adapter_series chooses: none, the metrics_top_k adapters updated
most recently (the default), or every adapter name ever registered (all). Tinker models likewise
(labels `model`, `tenant`: the same setting chooses among the live models). So a scrape's size is
bounded by the setting, not by the tenants registered.
"""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from service.control.controller import MetricsSnapshot
from service.registry.registry import AdapterState

SWAP_TIERS = ("host", "disk", "prefetched")


def render_prometheus(snap: MetricsSnapshot, tinker: Any = None) -> tuple[bytes, str]:
    """``tinker``: what the Tinker API shows when it is served (api/tinker/model_routes.py TinkerScrape:
    its gauges, its models by state and the chosen models' series, bounded like the adapters')."""
    reg = CollectorRegistry(auto_describe=False)
    if tinker is not None:
        from api.tinker.metrics import add_model_series, add_tinker_gauges

        add_tinker_gauges(reg, tinker.stats)
        add_model_series(reg, tinker.residency, tinker.models)

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=reg)

    by_state = gauge("lorafleet_adapters", "Adapters (newest run per name) by state", ("state",))
    for s in AdapterState:
        by_state.labels(s.value).set(snap.by_state.get(s, 0))
    residency = gauge("lorafleet_adapters_residency", "Live adapter runs by residency: resident (holds a slot), queued (waits for its first slot), evicted (swapped out, waits to come back)", ("residency",))
    for where in ("resident", "queued", "evicted"):
        residency.labels(where).set(snap.residency.get(where, 0))
    gauge("lorafleet_adapter_series", "Adapters that have per-adapter series in this scrape (metrics_adapter_series)").set(len(snap.adapters))
    _adapter_series(gauge, snap)
    gauge("lorafleet_slots_total", "Trainer adapter slots").set(snap.num_slots)
    gauge("lorafleet_slots_free", "Trainer adapter slots not held by a live run").set(snap.free_slots)
    count = gauge("lorafleet_swap_snapshots", "Evicted slots' snapshots on trainer rank 0, by tier (prefetched: read ahead from disk)", ("tier",))
    size = gauge("lorafleet_swap_bytes", "Bytes of evicted slots' snapshots on trainer rank 0, by tier", ("tier",))
    budget = gauge("lorafleet_swap_budget_bytes", "Budget of each swap tier on trainer rank 0 (swap_host_budget_mb, swap_disk_budget_mb)", ("tier",))
    for tier in SWAP_TIERS:
        t = snap.swap_tiers.get(tier, {})
        count.labels(tier).set(t.get("count", 0))
        size.labels(tier).set(t.get("bytes", 0))
        if "budget_bytes" in t:
            budget.labels(tier).set(t["budget_bytes"])
    counters = gauge("lorafleet_scheduler_events", "Scheduler events since start: evictions, restores, prefetches, placements, "
                     "rounds (the loop's passes that made a trainer call)", ("event",))
    for event in ("evictions", "restores", "prefetches", "placements", "rounds"):
        counters.labels(event).set(snap.scheduler_counters.get(event, 0))
    gauge("lorafleet_reconciles", "Reconcile passes since start (one per loop round)").set(snap.reconciles)
    spent = gauge("lorafleet_coordinator_seconds", "Coordinator time since start in the loop's per-round work: place (the trainer's "
                  "swaps included), reconcile, gather (waiting for ready work), gather_window (of it, the time after the "
                  "round's first call was ready, waiting for others to join), offer, train (the trainer call), settle, single "
                  "(operations that run alone: saves, exports, snapshots)", ("part",))
    for part in ("place", "reconcile", "gather", "gather_window", "offer", "train", "settle", "single"):
        spent.labels(part).set(snap.coordinator_seconds.get(part, 0.0))
    gauge("lorafleet_coordinator_gc_frozen_objects", "Objects of the coordinator's process left out of Python's cyclic "
          "collections since it came up (gc.freeze: service/modes.py freeze_startup_objects)").set(gc.get_freeze_count())
    passes = gauge("lorafleet_coordinator_gc_collections", "Passes of the coordinator's cyclic garbage collector since start, "
                   "by generation (2: full passes, which walk every object not frozen)", ("generation",))
    for generation, stats in enumerate(gc.get_stats()):
        passes.labels(str(generation)).set(stats["collections"])
    inflight = gauge("lorafleet_engine_inflight_requests", "Generation requests in flight", ("engine",))
    if snap.runtime is not None:
        for engine, n in snap.runtime.engine_inflight.items():
            inflight.labels(engine).set(n)
        gauge("lorafleet_rollout_queue_depth_total", "Rollout groups buffered for training, every adapter").set(
            sum(snap.runtime.queue_depth.values()))
        if snap.runtime.train_step_seconds is not None:
            gauge("lorafleet_train_step_seconds", "Wall time of the last mixed train call").set(snap.runtime.train_step_seconds)
    return generate_latest(reg), CONTENT_TYPE_LATEST


def _adapter_series(gauge, snap: MetricsSnapshot) -> None:  # noqa: ANN001 - the gauge factory above
    """The per-adapter series, for the snapshot's adapters only."""
    step = gauge("lorafleet_adapter_step", "Optimizer steps committed", ("adapter",))
    total = gauge("lorafleet_adapter_total_steps", "Steps the run will take", ("adapter",))
    samples = gauge("lorafleet_adapter_samples_trained", "Samples trained", ("adapter",))
    reward = gauge("lorafleet_adapter_reward_mean", "Mean reward of the last step", ("adapter",))
    loss = gauge("lorafleet_adapter_loss", "Loss of the last step", ("adapter",))
    version = gauge("lorafleet_adapter_weight_version", "Weight version the engines serve", ("adapter",))
    state = gauge("lorafleet_adapter_state", "1 for the adapter's current state", ("adapter", "state"))
    for r in snap.adapters:
        step.labels(r.name).set(r.step)
        samples.labels(r.name).set(r.samples_trained)
        state.labels(r.name, r.state.value).set(1)
        if r.total_steps is not None:
            total.labels(r.name).set(r.total_steps)
        if r.weight_version is not None:
            version.labels(r.name).set(r.weight_version)
        if "reward_mean" in r.last_metrics:
            reward.labels(r.name).set(r.last_metrics["reward_mean"])
        if "loss" in r.last_metrics:
            loss.labels(r.name).set(r.last_metrics["loss"])
    if snap.runtime is None:
        return
    names = {r.name for r in snap.adapters}
    queue = gauge("lorafleet_rollout_queue_depth", "Rollout groups buffered for training", ("adapter",))
    swap_out = gauge("lorafleet_adapter_swap_out_seconds", "Trainer time of the adapter's last swap-out (eviction)", ("adapter",))
    swap_in = gauge("lorafleet_adapter_swap_in_seconds", "Trainer time of the adapter's last swap-in (restore)", ("adapter",))
    for series, values in ((queue, snap.runtime.queue_depth), (swap_out, snap.runtime.swap_out_seconds),
                           (swap_in, snap.runtime.swap_in_seconds)):
        for name, value in values.items():
            if name in names:
                series.labels(name).set(value)
