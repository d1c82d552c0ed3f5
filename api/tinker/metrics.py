"""Tinker gauges for GET /metrics (Prometheus), from ``TinkerService.metrics()``.

The service's /metrics renders a fresh registry per scrape (api/metrics.py); it adds
these with ``add_tinker_gauges(registry, service.metrics())``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

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
}


def add_tinker_gauges(registry: CollectorRegistry, stats: dict[str, float]) -> None:
    for key, (name, doc) in GAUGES.items():
        Gauge(name, doc, registry=registry).set(stats.get(key, 0.0))
