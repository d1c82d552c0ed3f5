"""The one typed config tree: the job file (base model, placement, slots, trainer, engines,
rollout, adapters), the service settings (environment and settings file), quotas and the Ray
section. Validated once at start and passed down.

May import: service.errors, trainer.config, trainer.strict_model, trainer.losses (the loss table's names), trainer.platform,
rollout.config, rollout.tenant_code.
"""
