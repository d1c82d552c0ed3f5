"""The adapter registry, the service's single source of truth in SQLite: runs and their states,
slots and leases, the queue, steps and checkpoints recorded; its records and read views.

May import: service.config, service.errors.
"""
