"""SGLang engines: launch (with every CPU-only adjustment), watch and restart the server processes,
their HTTP client, the engine pool (versioned adapter loads, routing, abort), and adapter weights
on their way to an engine.

May import: rollout.config, rollout.naming, trainer.export, trainer.storage.
"""
