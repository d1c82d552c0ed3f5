"""Sampling sessions over the fleet's SGLang engines: ``create_sampling_session`` and ``asample``.

A sampling session names what it samples from: the base model, or a sampler checkpoint
(``save_weights_for_sampler``: a PEFT folder) of the caller's. Its adapter is loaded into an engine
when a request needs it there, under a name of its own (a session's weights never change: new
weights are a new checkpoint and a new session, as in Tinker). Which engine serves a request, and
which adapters each engine keeps, is api/tinker/sampling/engines.py (one routing rule; one LRU per
engine; an engine lost mid-request gives a retry on another). ``num_samples`` generations run
concurrently on one engine, sent as one batched request (they share the prompt's cache); the result is the SDK's SampleResponse
protobuf (tokens, per-token logprobs, stop reason).

Sessions are recorded in the service's registry (service/registry/sampling_records.py) when it has
one: a session outlives a restart of the service, its adapter loaded again on its next request. A
client made with ``record_stability_info=True`` has each sampled sequence recorded there under its
``sequence_id`` (the prompt, the tokens and the engine's log-probability of each, and the checkpoint
that sampled it): what stable_reinforce trains with (api/tinker/sampling/stability.py).

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

import math
import secrets
import uuid
from collections import Counter
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from api.tinker.futures import Outcome, server_error, user_error
from api.tinker.sampling.engines import EngineFailed, EngineSource, NoEngine, SamplerEngine, SamplerEngines, static_engines
from rollout.engines.client import EngineError, EngineUnavailable
from service.registry.sampling_records import SamplingRecords

MAX_TOPK = 20  # top-k logprobs per position a request may ask for
TOUCH_EVERY_S = 600.0  # a session in use restarts its record's day at most this often (a write to the registry)
SWEEP_EVERY_S = 3600.0  # expired sampling records are deleted at most this often (sampling_records.py S2)
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
@dataclass
class SamplingSession:
    tenant: str
    folder: str | Path | None  # the sampler checkpoint's PEFT folder, or None for the base model
    lora_name: str | None = None
    model_path: str | None = None  # the tinker:// path it was opened with
    session_id: str = ""
    engine: str | None = None  # the engine that served it last (routing's stickiness: sampler_engines.py)
    touched: float = field(default_factory=time.monotonic)  # when its record's day was last restarted
    lost: str | None = None  # why its weights cannot be sampled (restored after a restart, found torn: `session`)


def _engine_lost(err: BaseException) -> bool:
    """An engine failure another engine may not have: unreachable, dropped, timed out, or a 5xx."""
    return isinstance(err, EngineUnavailable) or (isinstance(err, EngineError) and (err.status is None or err.status >= 500))


class SglangSampler:
    def __init__(self, engines: str | list[str] | EngineSource, *, records: SamplingRecords | None = None,
                 max_loaded: int = 6, request_timeout_s: float = 600.0, refresh_s: float = 2.0,
                 engine_wait_s: float = 120.0):
        """``engines``: an SGLang server's URL, a list of them, or the fleet's list (an EngineSource,
        api/tinker/sampling/engines.py: followed as engines come and go). ``max_loaded``: sampler
        adapters kept loaded per engine (what the engines' max_loaded_loras leaves to Tinker).
        ``records``: the service's registry (service/registry/sampling_records.py): sampling sessions
        outlive a restart, and samples of clients made with record_stability_info are recorded for
        stable_reinforce; without it sessions live in memory and nothing is recorded."""
        if isinstance(engines, str):
            engines = [engines]
        source = static_engines(engines) if isinstance(engines, list) else engines
        self.engines = SamplerEngines(source, capacity=max_loaded, request_timeout_s=request_timeout_s,
                                      refresh_s=refresh_s, engine_wait_s=engine_wait_s)
        self.records = records
        self.sessions: dict[str, SamplingSession] = {}  # this process's sessions (the records hold them all)
        # folder -> why it cannot be sampled, or None: asked once of a session restored from the records, before
        # its adapter is loaded (the service sets it: its store checks the folder against its manifest;
        # an ephemeral sampler folder is written without waiting for the disk, trainer/storage/store.py S5)
        self.check_folder: Callable[[str], str | None] | None = None
        self.stable_reinforce = Counter()  # the stable_reinforce calls' statistics, summed (api/tinker/sampling/stability.py)
        self._swept = time.monotonic()

    # -- sessions --------------------------------------------------------------------------------------

    def create_session(self, tenant: str, folder: str | Path | None, model_path: str | None = None) -> str:
        sid = f"samp-{uuid.uuid4().hex[:16]}"
        if self.records is not None:  # durable before its id is answered
            self.records.record_sampling_session(sid, tenant, model_path, None if folder is None else str(folder))
        self.sessions[sid] = SamplingSession(tenant, folder, None if folder is None else f"tinker-{sid}", model_path, sid)
        return sid

    def session(self, tenant: str, sid: str) -> SamplingSession | None:
        """The tenant's session (another tenant's reads as absent); after a restart, from the records
        (its adapter is loaded again on demand). Each use restarts its day (sampling_records.py S2)."""
        s = self.sessions.get(sid)
        if s is not None:
            if s.tenant != tenant:
                return None
            if self.records is not None and time.monotonic() - s.touched > TOUCH_EVERY_S:
                self.records.sampling_session(tenant, sid)
                s.touched = time.monotonic()
            return s
        rec = self.records.sampling_session(tenant, sid) if self.records is not None else None
        if rec is None:
            return None
        s = self.sessions[sid] = SamplingSession(tenant, rec.folder, None if rec.folder is None else f"tinker-{sid}",
                                                 rec.model_path, sid)
        if rec.folder is not None and self.check_folder is not None:  # the machine may have stopped since it was saved
            s.lost = self.check_folder(str(rec.folder))
        return s

    @staticmethod
    def sglang_params(params: dict) -> dict:
        """SDK SamplingParams -> SGLang sampling_params (the seed is per sample: ``seeds``). ``stop``: None
        keeps the implicit stop at EOS; ``[]`` disables every stop, EOS included, so each sample runs to
        ``max_tokens`` (the SDK's documented meaning: SGLang's ``ignore_eos``)."""
        out = {"max_new_tokens": int(params.get("max_tokens") or 128), "temperature": float(params.get("temperature", 1.0)),
               "top_k": int(params.get("top_k", -1)), "top_p": float(params.get("top_p", 1.0))}
        stop = params.get("stop")
        if isinstance(stop, (list, tuple)) and not stop:
            out["ignore_eos"] = True
        elif isinstance(stop, str):
            out["stop"] = [stop]
        elif stop and all(isinstance(s, int) for s in stop):
            out["stop_token_ids"] = list(stop)
        elif stop:
            out["stop"] = list(stop)
        return out

    @staticmethod
    async def seeds(engine: SamplerEngine, seed: object, n: int) -> list[int | None]:
        """The sampling_seed of each of ``n`` samples; ValueError when a seed cannot be honoured."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"sampling_params.seed must be an integer, got {seed!r}")
        if engine.deterministic is None:  # asked once per engine
            engine.deterministic = bool((await engine.client.server_info()).get("enable_deterministic_inference"))
        if seed is None:
            return [secrets.randbelow(SEED_SPACE) for _ in range(n)] if engine.deterministic else [None] * n
        if not engine.deterministic:
            raise ValueError("sampling_params.seed is not served by this server's engine (it needs SGLang's "
                             "--enable-deterministic-inference, in engines.extra_server_args); leave seed unset")
        return [(seed + i) % SEED_SPACE for i in range(n)]

    # -- sampling --------------------------------------------------------------------------------------

    async def sample(self, session: SamplingSession, prompt: list[int], num_samples: int, params: dict,
                     options: LogprobOptions = LogprobOptions(), record_as: str | None = None) -> Outcome:
        """The request's SampleResponse, or its error. An engine that fails it (unreachable, dropped,
        timed out) is routed around and the request runs again on another (sampler_engines.py), until
        every engine in the fleet's list failed it. ``record_as``: the request id whose sequences are
        recorded (``<record_as>-<i>``, the acknowledgement's sample_sequence_ids) before the answer."""
        self._sweep_now_and_then()
        if session.lost is not None:
            return user_error(session.lost)
        try:
            options.check(len(prompt))
            sp = self.sglang_params(params)
            if record_as is not None and self.records is None:
                raise ValueError("record_stability_info is not served: this server keeps no sampling records")
        except (ValueError, TypeError) as err:
            return user_error(str(err))
        tried: set[str] = set()
        failures: list[str] = []
        while True:
            try:
                engine = await self.engines.acquire(session.lora_name, session.folder, session.engine, tried)
            except NoEngine as err:
                return server_error(f"sampling failed: {err}" + (f"; {'; '.join(failures)}" if failures else ""))
            except EngineFailed as err:
                if not _engine_lost(err.error):
                    return user_error(f"sampling failed: {err.error}") if err.error.status == 400 else server_error(str(err.error))
                self.engines.lost(err.engine, err.error)
                tried.add(err.engine.key)
                failures.append(f"engine {err.engine.entry.index}: {err.error}")
                continue
            except ValueError as err:  # the checkpoint's folder is not a PEFT adapter (deleted meanwhile)
                return user_error(f"sampling failed: {err}")
            session.engine = engine.key  # the session's engine from now on (its next requests, concurrent ones too)
            try:
                seeds = await self.seeds(engine, params.get("seed"), num_samples)
                # the group in one request (EngineClient.generate_many: one HTTP request, not one per sample)
                results = await engine.client.generate_many(
                    rids=[f"tinker::{uuid.uuid4().hex}" for _ in seeds], input_ids=prompt,
                    sampling_params=[sp if s is None else {**sp, "sampling_seed": s} for s in seeds],
                    lora_name=session.lora_name, logprob_start_len=options.start(len(prompt)),
                    top_logprobs_num=max(options.topk_prompt, options.topk_sample))
                error = None
            except ValueError as err:
                return user_error(str(err))
            except EngineError as err:
                error = err
            finally:
                await self.engines.release(engine, session.lora_name)
            if error is None:
                break
            if not _engine_lost(error):
                return user_error(f"sampling failed: {error}") if error.status == 400 else server_error(str(error))
            self.engines.lost(engine, error)
            tried.add(engine.key)
            failures.append(f"engine {engine.entry.index}: {error}")
        if record_as is not None:
            self.records.record_samples(record_as, session.tenant, session.session_id, session.model_path or "base", prompt,
                                        [(list(r.token_ids), list(r.logprobs)) for r in results])
        return Outcome(proto=_response(results, prompt, options))

    def _sweep_now_and_then(self) -> None:
        """Expired sessions and stability records deleted, at most every SWEEP_EVERY_S (one indexed DELETE
        on the serving loop, like the session reaper's sweeps: the API starts no thread)."""
        if self.records is None or time.monotonic() - self._swept < SWEEP_EVERY_S:
            return
        self._swept = time.monotonic()
        self.records.sweep_sampling_records()

    def metrics(self) -> dict[str, float]:
        """Per-engine counts (sampler_engines.py) and the stable_reinforce statistics, for /metrics."""
        return {**self.engines.metrics(), **{f"stable_reinforce.{k}": float(v) for k, v in self.stable_reinforce.items()}}

    async def aclose(self) -> None:
        await self.engines.aclose()


def _response(results: list, prompt: list[int], options: LogprobOptions) -> bytes:
    """The SDK's SampleResponse protobuf from the engine's generations."""
    from tinker.proto import tinker_public_pb2 as pb

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
    return msg.SerializeToString()


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
