"""GET /metrics: the controller's snapshot as Prometheus text.

A fresh CollectorRegistry per scrape (no process-global metric state): the
values are read from the registry and the runtime at scrape time, so they are
never stale and two apps in one process never share series.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from service.controller import MetricsSnapshot
from service.registry import AdapterState


def render_prometheus(snap: MetricsSnapshot, tinker: dict[str, float] | None = None) -> tuple[bytes, str]:
    """``tinker``: TinkerService.metrics() when the Tinker API is served (its gauges are added)."""
    reg = CollectorRegistry(auto_describe=False)
    if tinker is not None:
        from api.tinker.metrics import add_tinker_gauges

        add_tinker_gauges(reg, tinker)

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=reg)

    step = gauge("lorafleet_adapter_step", "Optimizer steps committed", ("adapter",))
    total = gauge("lorafleet_adapter_total_steps", "Steps the run will take", ("adapter",))
    samples = gauge("lorafleet_adapter_samples_trained", "Samples trained", ("adapter",))
    reward = gauge("lorafleet_adapter_reward_mean", "Mean reward of the last step", ("adapter",))
    loss = gauge("lorafleet_adapter_loss", "Loss of the last step", ("adapter",))
    version = gauge("lorafleet_adapter_weight_version", "Weight version the engines serve", ("adapter",))
    state = gauge("lorafleet_adapter_state", "1 for the adapter's current state", ("adapter", "state"))
    by_state = gauge("lorafleet_adapters", "Adapters (newest run per name) by state", ("state",))
    for s in AdapterState:
        by_state.labels(s.value).set(sum(1 for r in snap.adapters if r.state == s))
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
    residency = gauge("lorafleet_adapters_residency", "Live adapter runs by residency: resident (holds a slot), queued (waits for its first slot), evicted (swapped out, waits to come back)", ("residency",))
    for where in ("resident", "queued", "evicted"):
        residency.labels(where).set(sum(1 for r in snap.adapters if r.live and r.residency == where))
    gauge("lorafleet_slots_total", "Trainer adapter slots").set(snap.num_slots)
    gauge("lorafleet_slots_free", "Trainer adapter slots not held by a live run").set(snap.free_slots)
    queue = gauge("lorafleet_rollout_queue_depth", "Rollout groups buffered for training", ("adapter",))
    inflight = gauge("lorafleet_engine_inflight_requests", "Generation requests in flight", ("engine",))
    if snap.runtime is not None:
        for name, depth in snap.runtime.queue_depth.items():
            queue.labels(name).set(depth)
        for engine, n in snap.runtime.engine_inflight.items():
            inflight.labels(engine).set(n)
        swap_out = gauge("lorafleet_adapter_swap_out_seconds", "Trainer time of the adapter's last swap-out (eviction)", ("adapter",))
        swap_in = gauge("lorafleet_adapter_swap_in_seconds", "Trainer time of the adapter's last swap-in (restore)", ("adapter",))
        for name, seconds in snap.runtime.swap_out_seconds.items():
            swap_out.labels(name).set(seconds)
        for name, seconds in snap.runtime.swap_in_seconds.items():
            swap_in.labels(name).set(seconds)
        if snap.runtime.train_step_seconds is not None:
            gauge("lorafleet_train_step_seconds", "Wall time of the last mixed train call").set(snap.runtime.train_step_seconds)
    return generate_latest(reg), CONTENT_TYPE_LATEST
