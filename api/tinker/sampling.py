"""Sampling sessions over an SGLang engine: ``create_sampling_session`` and ``asample``.

A sampling session names what it samples from: the base model, or a sampler checkpoint
(``save_weights_for_sampler``: a PEFT folder) of the caller's. The adapter is loaded into
the engine once per session, under a name of its own (a session's weights never change:
new weights are a new checkpoint and a new session, as in Tinker). ``num_samples``
generations run concurrently on the engine; the result is the SDK's SampleResponse
protobuf (tokens, per-token logprobs, stop reason). Not (yet) served: prompt logprobs,
top-k logprobs, per-request seeds; asking for them is refused with a message.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from api.tinker.futures import Outcome, user_error
from rollout.client import EngineClient, EngineError
from rollout.weights import AdapterWeights


@dataclass
class SamplingSession:
    tenant: str
    folder: Path | None  # PEFT folder, or None for the base model
    lora_name: str | None = None
    model_path: str | None = None  # the tinker:// path it was opened with
    loaded: bool = False


class SglangSampler:
    def __init__(self, engine_url: str, *, request_timeout_s: float = 600.0, max_loaded: int = 6):
        """``max_loaded``: adapters kept loaded in the engine (below its max_loaded_loras); the least
        recently used session's adapter is unloaded to make room, and loaded again when used."""
        self.engine_url = engine_url
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, SamplingSession] = OrderedDict()
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, SamplingSession] = {}
        self._client: EngineClient | None = None
        self._load_lock: asyncio.Lock | None = None

    def _engine(self) -> EngineClient:
        if self._client is None:  # created on the serving loop (httpx clients bind to it)
            self._client = EngineClient(self.engine_url, request_timeout_s=self.request_timeout_s)
            self._load_lock = asyncio.Lock()
        return self._client

    def create_session(self, tenant: str, folder: Path | None, model_path: str | None = None) -> str:
        sid = f"samp-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = SamplingSession(tenant, folder, None if folder is None else f"tinker-{sid}", model_path)
        return sid

    def session(self, tenant: str, sid: str) -> SamplingSession | None:
        s = self.sessions.get(sid)
        return s if s is not None and s.tenant == tenant else None

    @staticmethod
    def sglang_params(params: dict) -> dict:
        """SDK SamplingParams -> SGLang sampling_params; ValueError for what is not served."""
        if params.get("seed") is not None:
            raise ValueError("sampling_params.seed is not supported by this server; leave it unset")
        out = {"max_new_tokens": int(params.get("max_tokens") or 128), "temperature": float(params.get("temperature", 1.0)),
               "top_k": int(params.get("top_k", -1)), "top_p": float(params.get("top_p", 1.0))}
        stop = params.get("stop")
        if isinstance(stop, str):
            out["stop"] = [stop]
        elif stop and all(isinstance(s, int) for s in stop):
            out["stop_token_ids"] = list(stop)
        elif stop:
            out["stop"] = list(stop)
        return out

    async def sample(self, session: SamplingSession, prompt: list[int], num_samples: int, params: dict) -> Outcome:
        from tinker.proto import tinker_public_pb2 as pb

        try:
            sp = self.sglang_params(params)
        except (ValueError, TypeError) as err:
            return user_error(str(err))
        engine = self._engine()
        try:
            if session.lora_name is not None:
                async with self._load_lock:
                    if not session.loaded:
                        while len(self._loaded) >= self.max_loaded:
                            _, old = self._loaded.popitem(last=False)
                            await engine.unload_adapter(old.lora_name)
                            old.loaded = False
                        await engine.load_adapter(session.lora_name, AdapterWeights.from_folder(session.folder), transfer="disk")
                        session.loaded = True
                        self._loaded[session.lora_name] = session
                    self._loaded.move_to_end(session.lora_name)
            results = await asyncio.gather(*(
                engine.generate(rid=f"tinker::{uuid.uuid4().hex}", input_ids=prompt, sampling_params=sp, lora_name=session.lora_name)
                for _ in range(num_samples)))
        except EngineError as err:
            return user_error(f"sampling failed: {err}") if err.status == 400 else Outcome(json={"error": str(err), "category": "server"})
        msg = pb.SampleResponse()
        for r in results:
            seq = msg.sequences.add()
            seq.stop_reason = pb.STOP_REASON_LENGTH if r.finish_reason == "length" else pb.STOP_REASON_STOP
            seq.tokens = np.asarray(r.token_ids, dtype=np.int32).tobytes()
            seq.logprobs = np.asarray(r.logprobs, dtype=np.float32).tobytes()
        return Outcome(proto=msg.SerializeToString())

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
