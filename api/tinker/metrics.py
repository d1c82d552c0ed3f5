"""Tinker gauges and counters for GET /metrics (Prometheus), from ``TinkerService.metrics()``.

The service's /metrics renders a fresh registry per scrape (api/metrics.py); it adds
these with ``add_tinker_gauges(registry, service.metrics())``. The sampler's keys
(api/tinker/sampling/sampler.py ``SglangSampler.metrics``) become labelled counters:
``sampler.<count>.<engine index>`` -> ``lorafleet_tinker_sample_requests_total{engine="<index>"}``
and the adapter loads and unloads (bounded: one series per engine of the fleet), and
``stable_reinforce.<statistic>`` -> the stable_reinforce calls' statistics, summed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

GAUGES = {
    "mixed_steps": ("lorafleet_tinker_mixed_steps", "Mixed forward_backward steps run for Tinker calls"),
    "forward_backward_calls": ("lorafleet_tinker_forward_backward_calls", "Tinker forward_backward calls run"),
    "coalescing_factor": ("lorafleet_tinker_coalescing_factor", "Tinker forward_backward calls per mixed step"),
    "joined_steps": ("lorafleet_tinker_joined_steps", "Training-loop train calls that carried Tinker forward_backward calls"),
    "joined_calls": ("lorafleet_tinker_joined_calls", "Tinker forward_backward calls that rode in training-loop train calls"),
    "models": ("lorafleet_tinker_models", "Tinker models (resident or evicted)"),
    "models_evicted": ("lorafleet_tinker_models_evicted", "Tinker models swapped out of their trainer slot (idle eviction)"),
    "models_waiting_for_slot": ("lorafleet_tinker_models_waiting_for_slot", "Tinker models whose calls wait for a trainer slot"),
    "evictions": ("lorafleet_tinker_evictions", "Idle Tinker models swapped out so far"),
    "restores": ("lorafleet_tinker_restores", "Evicted Tinker models swapped back in so far"),
    "sessions": ("lorafleet_tinker_sessions", "Live Tinker sessions"),
    "snapshots_taken": ("lorafleet_tinker_snapshots_taken", "Snapshots of Tinker models taken since start (tinker_durability; a graceful stop's included)"),
    "snapshots_recorded": ("lorafleet_tinker_snapshots_recorded", "Of them, written and recorded (the model's durable state)"),
    "snapshots_failed": ("lorafleet_tinker_snapshots_failed", "Of them, background writes that failed (the previous snapshot stands)"),
    "snapshot_loop_seconds": ("lorafleet_tinker_snapshot_loop_seconds",
                              "Training-loop time spent taking them (what they held up: a background one only while its state is gathered)"),
    "snapshot_background_seconds": ("lorafleet_tinker_snapshot_background_seconds",
                                    "Time from taking a background snapshot to recording it, summed"),
    "record_commits": ("lorafleet_tinker_record_commits", "Group commits of the Tinker records (each durable, fsync'd) since start"),
    "record_writes": ("lorafleet_tinker_record_writes", "Statements those commits carried (futures, results, journal entries)"),
    "record_commit_seconds": ("lorafleet_tinker_record_commit_seconds",
                              "Time spent in those commits since start (divided by the commits: the durable write a call's answer waits for)"),
    "retrieve_try_again": ("lorafleet_tinker_retrieve_try_again",
                           "retrieve_future polls the coordinator answered try again since start (with the API front on, a "
                           "queued call's repeat polls are held by the front and do not count: api/front/parked_polls.py)"),
    "futures_announced": ("lorafleet_tinker_futures_announced",
                          "Futures whose finish was told to the API front since start (the polls it held for them then pass)"),
}
# per engine (label engine = its index in the fleet); Prometheus adds _total
SAMPLER_COUNTERS = {
    "requests": ("lorafleet_tinker_sample_requests", "Tinker sample requests routed to each engine (a retry counts again)"),
    "adapter_loads": ("lorafleet_tinker_sampler_adapter_loads", "Tinker sampler adapters loaded into each engine"),
    "adapter_unloads": ("lorafleet_tinker_sampler_adapter_unloads", "Tinker sampler adapters unloaded from each engine for room"),
}
# the sampler's waits for adapter room (api/tinker/sampling/engines.py R3); Prometheus adds _total
SAMPLER_WAITS = {
    "room_waits": ("lorafleet_tinker_sample_room_waits", "Tinker sample requests that waited for sampler adapter room (every engine's adapters in use)"),
    "waits_with_room": ("lorafleet_tinker_sample_waits_with_room", "Of those, requests that waited while an engine had room (a routing fault: stays 0)"),
}
STABLE_REINFORCE = {
    "calls": "stable_reinforce forward/forward_backward calls",
    "sequences": "sampled sequences trained on with stable_reinforce",
    "masked_sequences": "of them, sequences masked whole (geometric-mean ratio out of bounds)",
    "sampled_tokens": "sampled tokens trained on with stable_reinforce",
    "truncated_tokens": "of them, kept tokens whose importance ratio was truncated at ratio_cap",
    "ratio_sum": "sum of the trainer/sampler importance ratios of those tokens (divide by sampled_tokens: the mean)",
    "kl_sum": "sum of (lp - q)^2 / 2 over those tokens",
}


def add_tinker_gauges(registry: CollectorRegistry, stats: dict[str, float]) -> None:
    for key, (name, doc) in GAUGES.items():
        Gauge(name, doc, registry=registry).set(stats.get(key, 0.0))
    counters = {what: Counter(name, doc, ["engine"], registry=registry) for what, (name, doc) in SAMPLER_COUNTERS.items()}
    for key, value in stats.items():
        if key.startswith("sampler."):
            _, what, engine = key.split(".", 2)
            if what in counters:
                counters[what].labels(engine).inc(value)
    for what, (name, doc) in SAMPLER_WAITS.items():
        Counter(name, doc, registry=registry).inc(stats.get(f"sampler_waits.{what}", 0.0))
    for what, doc in STABLE_REINFORCE.items():
        Counter(f"lorafleet_tinker_stable_reinforce_{what}", doc, registry=registry).inc(stats.get(f"stable_reinforce.{what}", 0.0))


# One series per model, for the models a scrape shows (api/tinker/model_routes.py TinkerScrape: the
# metrics_adapter_series setting chooses them, as it does the runs'), labelled model and tenant.
MODEL_SERIES = (  # (name, doc, the row's value)
    ("lorafleet_tinker_model_step", "Optimizer steps the Tinker model applied", lambda r: r.step),
    ("lorafleet_tinker_model_tokens_trained", "Datum positions of the model's forward_backward calls that ran",
     lambda r: r.tokens_trained),
    ("lorafleet_tinker_model_loss", "loss:sum of the model's last forward_backward call", lambda r: r.last_loss),
    ("lorafleet_tinker_model_sample_calls", "Sample requests of sampling sessions on the model's sampler checkpoints",
     lambda r: r.sample_calls),
    ("lorafleet_tinker_model_admissions", "Times the model came into a trainer slot", lambda r: r.admissions),
)


def add_model_series(registry: CollectorRegistry, residency: dict[str, int], models: list) -> None:  # ModelRow list
    """The models by state, and the chosen models' own series (bounded: one set per model shown)."""
    by_state = Gauge("lorafleet_tinker_models_residency", "Tinker models by state: resident (holds a slot), queued (waits "
                     "for its first slot), evicted (out of its slot)", ["residency"], registry=registry)
    for where in ("resident", "queued", "evicted"):
        by_state.labels(where).set(residency.get(where, 0))
    Gauge("lorafleet_tinker_model_series", "Tinker models that have series of their own in this scrape (metrics_adapter_series)",
          registry=registry).set(len(models))
    series = [(Gauge(name, doc, ["model", "tenant"], registry=registry), value) for name, doc, value in MODEL_SERIES]
    state = Gauge("lorafleet_tinker_model_state", "1 for the model's state (resident, queued, evicted)", ["model", "tenant", "state"],
                  registry=registry)
    slot = Gauge("lorafleet_tinker_model_slot", "The trainer slot the model holds (resident models only)", ["model", "tenant"],
                 registry=registry)
    for r in models:
        for gauge, value_of in series:
            value = value_of(r)
            if value is not None:
                gauge.labels(r.model_id, r.owner).set(value)
        state.labels(r.model_id, r.owner, r.residency).set(1)
        if r.slot is not None:
            slot.labels(r.model_id, r.owner).set(r.slot)
