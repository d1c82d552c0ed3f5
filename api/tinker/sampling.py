"""Sampling sessions over an SGLang engine: ``create_sampling_session`` and ``asample``.

A sampling session names what it samples from: the base model, or a sampler checkpoint
(``save_weights_for_sampler``: a PEFT folder) of the caller's. The adapter is loaded into
the engine once per session, under a name of its own (a session's weights never change:
new weights are a new checkpoint and a new session, as in Tinker). ``num_samples``
generations run concurrently on the engine; the result is the SDK's SampleResponse
protobuf (tokens, per-token logprobs, stop reason).

Options served (the SDK's SamplingParams and SampleRequest):
  * ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``stop`` -> SGLang's sampling params;
  * ``seed``: sample i of a request is drawn with SGLang's ``sampling_seed`` = seed + i, so
    the same seed gives the same samples (and the samples of one request differ). SGLang
    honours ``sampling_seed`` only on a server started with ``--enable-deterministic-
    inference`` (engines.extra_server_args); on any other server a seed is refused with a
    message saying so (it would be ignored silently). On a deterministic server, unseeded
    samples get fresh random seeds (else SGLang uses one fixed seed for all of them);
  * ``prompt_logprobs`` (with ``prompt_logprobs_last_n``), ``topk_prompt_logprobs``,
    ``topk_sample_logprobs`` (at most ``MAX_TOPK``): SGLang's input/output logprobs, in the
    SDK's layout (NaN where not computed; top-k sentinel token 0, logprob -99999).
Not served (refused with a message): ``target_prompt_logprobs``, ``prompt_alt_tokens_k``.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from api.tinker.futures import Outcome, user_error

MAX_TOPK = 20  # top-k logprobs per position a request may ask for
SEED_SPACE = 2**63  # SGLang's sampling_seed is a signed 64-bit integer
TOPK_MASK = (0, -99999.0)  # the SDK's sentinel for a position without top-k (tinker.types.topk_logprobs)


@dataclass(frozen=True)
class LogprobOptions:
    """What a sample request asks for besides the samples (SDK SampleRequest fields)."""

    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    last_n: int | None = None  # score only the prompt's last N tokens

    def check(self, prompt_len: int) -> None:
        for name, k in (("topk_prompt_logprobs", self.topk_prompt), ("topk_sample_logprobs", self.topk_sample)):
            if not 0 <= k <= MAX_TOPK:
                raise ValueError(f"{name}={k} not supported: 0..{MAX_TOPK}")
        if self.last_n is not None and not 1 <= self.last_n <= prompt_len:
            raise ValueError(f"prompt_logprobs_last_n={self.last_n} not supported: 1..{prompt_len} (the prompt's length)")

    @property
    def wants_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt > 0

    def start(self, prompt_len: int) -> int:
        """SGLang's logprob_start_len: -1 (no prompt logprobs), else where its lists begin: one
        position before the first scored one (SGLang gives no logprob for its first position)."""
        if not self.wants_prompt:
            return -1
        return 0 if self.last_n is None else max(0, prompt_len - self.last_n - 1)

    def first_scored(self, prompt_len: int) -> int:
        """The first prompt position whose logprobs are returned (earlier ones: not computed)."""
        return 0 if self.last_n is None else prompt_len - self.last_n
from rollout.engines.client import EngineClient, EngineError
from rollout.engines.weights import AdapterWeights
from service.scheduling.residency import AdapterLru


@dataclass
class SamplingSession:
    tenant: str
    folder: Path | None  # PEFT folder, or None for the base model
    lora_name: str | None = None
    model_path: str | None = None  # the tinker:// path it was opened with
    loaded: bool = False


class SglangSampler:
    def __init__(self, engine_url: str, *, request_timeout_s: float = 600.0, max_loaded: int = 6):
        """``max_loaded``: adapters kept loaded in the engine (below its max_loaded_loras), across every
        tenant's sessions, by the one rule of recency (service/scheduling/residency.py AdapterLru): a session's
        adapter is loaded when it samples; to make room, the least recently used one that no request
        is sampling from is unloaded (loaded again when its session samples next). A request that
        finds every loaded adapter in use waits for one to be released: it never fails for room."""
        self.engine_url = engine_url
        self.max_loaded = max_loaded
        self._lru = AdapterLru(max_loaded)
        self._in_use: dict[str, int] = {}  # lora name -> requests sampling from it now
        self._by_name: dict[str, SamplingSession] = {}
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, SamplingSession] = {}
        self._client: EngineClient | None = None
        self._room: asyncio.Condition | None = None  # guards loads and unloads; notified when a request ends
        self._seeded: bool | None = None  # the engine honours sampling_seed (asked on the first seeded request)

    def _engine(self) -> EngineClient:
        if self._client is None:  # created on the serving loop (httpx clients bind to it)
            self._client = EngineClient(self.engine_url, request_timeout_s=self.request_timeout_s)
            self._room = asyncio.Condition()
        return self._client

    async def _acquire(self, engine: EngineClient, session: SamplingSession) -> None:
        """The session's adapter loaded and counted in use (unloading least recently used idle ones
        first; waiting while every loaded one is in use)."""
        name = session.lora_name
        async with self._room:
            while True:
                victims = self._lru.room_for(name, lambda n: self._in_use.get(n, 0) > 0)
                if victims is not None:
                    break
                await self._room.wait()  # every loaded adapter is sampling: the next to finish makes room
            for old in victims:
                await engine.unload_adapter(old)
                self._lru.forget(old)
                self._by_name.pop(old).loaded = False
            if name not in self._lru:
                await engine.load_adapter(name, AdapterWeights.from_folder(session.folder), transfer="disk")
                session.loaded = True
                self._lru.loaded(name)
                self._by_name[name] = session
            self._lru.touch(name)
            self._in_use[name] = self._in_use.get(name, 0) + 1

    async def _release(self, name: str) -> None:
        async with self._room:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]
            self._room.notify_all()

    def create_session(self, tenant: str, folder: Path | None, model_path: str | None = None) -> str:
        sid = f"samp-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = SamplingSession(tenant, folder, None if folder is None else f"tinker-{sid}", model_path)
        return sid

    def session(self, tenant: str, sid: str) -> SamplingSession | None:
        s = self.sessions.get(sid)
        return s if s is not None and s.tenant == tenant else None

    @staticmethod
    def sglang_params(params: dict) -> dict:
        """SDK SamplingParams -> SGLang sampling_params (the seed is per sample: ``seeds``)."""
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

    async def _deterministic(self, engine: EngineClient) -> bool:
        """Whether the engine honours sampling_seed (started with --enable-deterministic-inference); asked once."""
        if self._seeded is None:
            info = await engine.server_info()
            self._seeded = bool(info.get("enable_deterministic_inference"))
        return self._seeded

    async def seeds(self, engine: EngineClient, seed: object, n: int) -> list[int | None]:
        """The sampling_seed of each of ``n`` samples; ValueError when a seed cannot be honoured."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"sampling_params.seed must be an integer, got {seed!r}")
        deterministic = await self._deterministic(engine)
        if seed is None:
            return [secrets.randbelow(SEED_SPACE) for _ in range(n)] if deterministic else [None] * n
        if not deterministic:
            raise ValueError("sampling_params.seed is not served by this server's engine (it needs SGLang's "
                             "--enable-deterministic-inference, in engines.extra_server_args); leave seed unset")
        return [(seed + i) % SEED_SPACE for i in range(n)]

    async def sample(self, session: SamplingSession, prompt: list[int], num_samples: int, params: dict,
                     options: LogprobOptions = LogprobOptions()) -> Outcome:
        from tinker.proto import tinker_public_pb2 as pb

        engine = self._engine()
        try:
            options.check(len(prompt))
            sp = self.sglang_params(params)
            seeds = await self.seeds(engine, params.get("seed"), num_samples)
        except (ValueError, TypeError) as err:
            return user_error(str(err))
        except EngineError as err:
            return Outcome(json={"error": str(err), "category": "server"})
        acquired = False
        try:
            if session.lora_name is not None:
                await self._acquire(engine, session)
                acquired = True
            results = await asyncio.gather(*(
                engine.generate(rid=f"tinker::{uuid.uuid4().hex}", input_ids=prompt,
                                sampling_params=sp if s is None else {**sp, "sampling_seed": s}, lora_name=session.lora_name,
                                logprob_start_len=options.start(len(prompt)),
                                top_logprobs_num=max(options.topk_prompt, options.topk_sample))
                for s in seeds))
        except EngineError as err:
            return user_error(f"sampling failed: {err}") if err.status == 400 else Outcome(json={"error": str(err), "category": "server"})
        finally:
            if acquired:
                await self._release(session.lora_name)
        msg = pb.SampleResponse()
        for r in results:
            seq = msg.sequences.add()
            seq.stop_reason = pb.STOP_REASON_LENGTH if r.finish_reason == "length" else pb.STOP_REASON_STOP
            seq.tokens = np.asarray(r.token_ids, dtype=np.int32).tobytes()
            seq.logprobs = np.asarray(r.logprobs, dtype=np.float32).tobytes()
            if options.topk_sample:
                _fill_topk(seq.topk_sampled_logprobs, r.top_logprobs or [], len(r.token_ids), options.topk_sample, 0)
        if options.wants_prompt:  # the prompt's logprobs are the same for every sample: the first one's
            first, start, keep = results[0], options.start(len(prompt)), options.first_scored(len(prompt))
            if options.prompt_logprobs:
                lps = [math.nan] * len(prompt)
                for i, lp in enumerate(first.prompt_logprobs or []):
                    if keep <= start + i < len(prompt) and lp is not None:
                        lps[start + i] = lp
                msg.prompt_logprobs = np.asarray(lps, dtype=np.float32).tobytes()
            if options.topk_prompt:
                _fill_topk(msg.topk_prompt_logprobs, first.prompt_top_logprobs or [], len(prompt), options.topk_prompt, start,
                           keep)
        return Outcome(proto=msg.SerializeToString())

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _fill_topk(out, tops: list, length: int, k: int, start: int, keep: int = 0) -> None:  # noqa: ANN001 - a pb.TopkLogprobs
    """The SDK's dense (length, k) top-k matrices from SGLang's per-position lists (which begin
    at position ``start``; positions before ``keep`` are not returned); positions without them
    hold the SDK's sentinel."""
    ids = np.full((length, k), TOPK_MASK[0], dtype=np.int32)
    lps = np.full((length, k), TOPK_MASK[1], dtype=np.float32)
    for i, pos in enumerate(tops):
        if pos is not None and keep <= start + i < length:
            for j, (tid, lp) in enumerate(pos[:k]):
                ids[start + i, j], lps[start + i, j] = tid, lp
    out.token_ids, out.logprobs, out.k, out.length = ids.tobytes(), lps.tobytes(), k, length
