"""lorafleet's rollout side: from "an adapter is registered" to "a scored group is ready for training".

Modules, one role each:
  config        pydantic config: EngineConfig, DataConfig, RewardConfig, SamplingConfig, RolloutConfig
  sglang_cpu    the SGLang launch command, with every CPU-only adjustment (and why) in one place
  sglang_server server entry point on CPU (pin_memory no-op in every server process)
  engine        EngineProcess: start / wait_ready / stop / kill / restart one server
  client        EngineClient: async HTTP client of one server (generate, adapters, abort, health)
  weights       AdapterWeights: one adapter version, sent as tensors or as a PEFT folder
  naming        request ids "<adapter>::<uuid4hex>" and served names "<adapter>@v<k>"
  pool          EnginePool: live versioned updates, abort by prefix, least-in-flight routing
  data          DataSource: JSONL/Parquet prompts, per-epoch shuffle, resumable cursor
  rewards       built-in and custom rewards, failure-safe scoring
  groups        RolloutGroup (the message to training), advantages, AdapterBuffer
  worker        RolloutCore: the asyncio rollout loop over all active adapters
  worker_actor  RolloutWorker: the Ray actor around RolloutCore (the service's interface)

Importing `rollout` imports nothing heavy; sglang itself is only imported inside server processes.
"""
