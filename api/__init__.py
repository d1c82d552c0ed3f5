"""The API: the FastAPI control plane (REST under /v1, wire models, auth, errors, metrics, the
dashboard), the front process (`front/`), the Tinker wire protocol (`tinker/`) and the
`lorafleet` command line (`cli/`).

May import: api, service, trainer.config, trainer.rounds, trainer.storage, rollout.
"""
