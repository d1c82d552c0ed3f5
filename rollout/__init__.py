"""lorafleet's rollout side: from "an adapter is registered" to "a scored group is ready for training".

Modules, one role each:
  config        pydantic config: EngineConfig, DataConfig, RewardConfig, SamplingConfig, RolloutConfig
  engines/      the SGLang engines: launch (CPU adjustments), process, HTTP client, pool, adapter weights
  naming        request ids "<adapter>::<uuid4hex>" and served names "<adapter>@v<k>"
  data          DataSource: JSONL/Parquet prompts, per-epoch shuffle, resumable cursor
  rewards       built-in and custom rewards, failure-safe scoring
  rollouts      how a group's trajectories are made (single-turn, environments, rollout functions)
  environment   multi-turn environments (reset/step); context: the engine client a rollout gets
  trajectory    one rollout of one sample, turn by turn
  tenant_code   tenant code named by import path (rewards, rollouts)
  groups        RolloutGroup (the message to training), advantages, AdapterBuffer
  messages      what the worker and the service say to each other: AdapterRollout, AdapterStats,
                EngineHealth, the publish outcomes, RolloutError
  worker        RolloutCore: the asyncio rollout loop over all active adapters
  worker_actor  RolloutWorker: the Ray actor around RolloutCore (the service's interface)

Importing `rollout` imports nothing heavy; sglang itself is only imported inside server processes.

May import: rollout, trainer.config, trainer.strict_model, trainer.platform, trainer.storage.
"""
