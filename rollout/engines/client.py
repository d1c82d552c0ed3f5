"""Async HTTP client of one SGLang server (httpx): generate, adapters, abort, health.

Every call has a timeout; a failed call raises `EngineError` carrying the
status and the response body, or `EngineUnavailable` when the server cannot be
reached (connection refused or dropped: the engine is likely dead).

What stock SGLang 0.5.23 does and does not offer (FINDINGS.md), and how the
client learns what a server offers (`capabilities`): the server's
/openapi.json lists the fields of each request type. Upstream pull requests
add a ``prefix`` field to /abort_request (sgl-project/sglang#30912, #32237)
and an ``upsert`` field to adapter loading (#30913, #32238); a server whose
schema has the field supports the feature, any other server gets the
stock-SGLang path (exact rids; versioned names + unload).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict

from rollout.engines.weights import AdapterWeights

_T = TypeVar("_T")


class EngineError(RuntimeError):
    """An engine answered with an error; `body` is its response text."""

    def __init__(self, message: str, *, url: str, status: int | None = None, body: str = ""):
        detail = f"{message} ({url}"
        detail += f", HTTP {status}" if status is not None else ""
        detail += f"): {body[:2000]}" if body else ")"
        super().__init__(detail)
        self.url = url
        self.status = status
        self.body = body

    def __reduce__(self):  # keep attributes across Ray's pickling
        return (_rebuild_engine_error, (type(self), self.args[0], self.url, self.status, self.body))


def _rebuild_engine_error(cls, detail, url, status, body):
    err = cls.__new__(cls)
    RuntimeError.__init__(err, detail)
    err.url, err.status, err.body = url, status, body
    return err


class EngineUnavailable(EngineError):
    """The engine could not be reached, or dropped the connection mid-request."""


class GenerateResult(BaseModel):
    """One finished (or aborted) generation."""

    model_config = ConfigDict(frozen=True)

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[float]  # one per token in token_ids: log p(token | prefix) under the served weights
    finish_reason: str  # "stop" | "length" | "abort" | ...
    prompt_tokens: int
    # Only when asked for (generate's logprob_start_len >= 0 / top_logprobs_num > 0; the Tinker sampler):
    # log p(prompt[i] | prompt[:i]) from logprob_start_len on (None where not computed: the first token),
    prompt_logprobs: list[float | None] | None = None
    # and the top tokens at each prompt / generated position: [(token id, logprob), ...] or None.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


class ServerCapabilities(BaseModel):
    model_config = ConfigDict(frozen=True)

    prefix_abort: bool = False  # /abort_request {"rid": prefix, "prefix": true}
    upsert_from_tensors: bool = False  # /load_lora_adapter_from_tensors {"upsert": true}
    upsert_from_path: bool = False  # /load_lora_adapter {"upsert": true}


def parse_generate_response(rid: str, body: dict[str, Any]) -> GenerateResult:
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    token_ids = list(body.get("output_ids") or [])
    raw_lp = meta.get("output_token_logprobs") or []
    # SGLang's entries are [logprob, token_id, token_text_or_None].
    logprobs = [float(e[0]) for e in raw_lp]
    if raw_lp and [int(e[1]) for e in raw_lp] != token_ids:
        raise ValueError(f"request {rid}: logprob token ids do not match output_ids")
    raw_in = meta.get("input_token_logprobs")

    def _tops(raw: list | None) -> list[list[tuple[int, float]] | None] | None:
        if raw is None:
            return None
        return [None if pos is None else [(int(e[1]), float(e[0])) for e in pos] for pos in raw]

    return GenerateResult(
        prompt_logprobs=None if raw_in is None else [None if e[0] is None else float(e[0]) for e in raw_in],
        prompt_top_logprobs=_tops(meta.get("input_top_logprobs")),
        top_logprobs=_tops(meta.get("output_top_logprobs")),
        rid=rid,
        token_ids=token_ids,
        text=body.get("text") or "",
        logprobs=logprobs,
        finish_reason=str(finish.get("type", "unknown")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
    )


KEEPALIVE_EXPIRY_S = 2.0  # how long EngineClient keeps an idle connection to an engine
# How long the engines lorafleet starts keep an idle connection (SGLANG_TIMEOUT_KEEP_ALIVE, set by
# rollout/engines/sglang_cpu.py; SGLang's own default is 5 s). Invariant: the client drops an idle
# connection before the server does, or a request can go out on a connection the server is closing
# and fail with ReadError. The two clocks start at different moments: the server's when it sent the
# answer, the client's when its loop read it. Under load the client reads late: in a full test run
# the coordinator, busy with a burst of 344 answers, read one about 3 s late and reused its connection
# just as SGLang's 5 s ran out (the cookbook RL recipe lost a sample call, issue 41). So the margin
# must cover the client's worst lag, not only the two timeouts: 60 s against 2 s.
ENGINE_KEEP_ALIVE_S = 60


class EngineClient:
    """Client of one SGLang server at `base_url`. Use as an async context manager, or call `aclose()`."""

    def __init__(self, base_url: str, *, request_timeout_s: float = 600.0, admin_timeout_s: float = 120.0,
                 max_connections: int = 512, tp_size: int = 1):
        self.base_url = base_url.rstrip("/")
        self.tp_size = tp_size  # tensor loads carry one copy of the weights per TP rank
        self.request_timeout_s = request_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(admin_timeout_s, connect=10.0),
            # Idle connections are dropped here long before the engine drops them (ENGINE_KEEP_ALIVE_S).
            # With httpx's default expiry and SGLang's keep-alive both at 5 s, a request sent after a pause
            # of about 5 s went out on a connection the engine was closing and failed with ReadError: CI's
            # DPO recipe lost a step's reference log-probs that way (tests/unit/test_keepalive_order.py
            # holds the order). Idle ones are not capped below the
            # busy cap: httpcore counts busy connections against the idle cap, so with more requests in
            # flight than it every answered one closed its connection (seen in the API front, issue 41).
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, *, timeout: float | None = None, **kwargs) -> httpx.Response:
        url = self.base_url + path
        try:
            resp = await self._http.request(method, path, timeout=timeout or self.admin_timeout_s, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            raise EngineUnavailable(f"{method} {path} failed: {type(e).__name__}: {e}", url=url) from e
        except httpx.TimeoutException as e:
            raise EngineError(f"{method} {path} timed out after {timeout or self.admin_timeout_s} s", url=url) from e
        if resp.status_code >= 400:
            raise EngineError(f"{method} {path} failed", url=url, status=resp.status_code, body=resp.text)
        return resp

    # --- generation --------------------------------------------------------------------------

    async def generate(
        self,
        *,
        rid: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        lora_name: str | None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> GenerateResult:
        """Generate one response for `input_ids` with adapter `lora_name` (None = base model).
        `logprob_start_len` >= 0: also the prompt's logprobs from that position on;
        `top_logprobs_num` > 0: also that many top tokens at each scored position."""
        return await self._generate(rid, list(input_ids), sampling_params, lora_name, logprob_start_len, top_logprobs_num,
                                    lambda body: parse_generate_response(rid, body))

    async def generate_many(
        self,
        *,
        rids: list[str],
        input_ids: list[int],
        sampling_params: list[dict[str, Any]],
        lora_name: str | None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> list[GenerateResult]:
        """``len(rids)`` generations of one prompt (one per rid and sampling_params entry, in that order),
        sent as one /generate request in SGLang's batch form. Why one request: a Tinker sample of a
        group of n cost n requests, and the HTTP client and the engine's HTTP server spent per request
        (issue 41: a third of the coordinator's busy time was its HTTP client to the engines).
        The engine runs them as n requests, each with its own rid (abort by rid or prefix as before)."""
        if len(rids) != len(sampling_params) or not rids:
            raise ValueError(f"generate_many: {len(rids)} rids and {len(sampling_params)} sampling_params (one each, at least one)")

        def read(bodies: Any) -> list[GenerateResult]:
            if not isinstance(bodies, list) or len(bodies) != len(rids):
                raise ValueError(f"expected a list of {len(rids)} answers")
            return [parse_generate_response(rid, body) for rid, body in zip(rids, bodies)]

        return await self._generate(list(rids), [list(input_ids)] * len(rids), list(sampling_params), lora_name,
                                    logprob_start_len, top_logprobs_num, read)

    async def _generate(self, rid: Any, input_ids: Any, sampling_params: Any, lora_name: str | None, logprob_start_len: int,
                        top_logprobs_num: int, read: Callable[[Any], _T]) -> _T:
        """One POST /generate (one request, or SGLang's batch form when the fields are lists), its answer by `read`."""
        payload = {
            "rid": rid,
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "lora_path": lora_name,
            "return_logprob": True,
            "logprob_start_len": logprob_start_len,
        }
        if top_logprobs_num > 0:
            payload["top_logprobs_num"] = top_logprobs_num
        resp = await self._call("POST", "/generate", json=payload, timeout=self.request_timeout_s)
        try:
            return read(resp.json())
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise EngineError(f"unreadable /generate answer: {e}", url=self.base_url + "/generate", status=resp.status_code, body=resp.text) from e

    async def abort(self, rid: str) -> None:
        """Abort the request with exactly this rid (the scheduler matches by prefix: keep rids prefix-free)."""
        await self._call("POST", "/abort_request", json={"rid": rid})

    async def abort_prefix(self, prefix: str) -> None:
        """Abort every request whose rid starts with `prefix`; only on servers with capabilities().prefix_abort."""
        await self._call("POST", "/abort_request", json={"rid": prefix, "prefix": True})

    # --- adapters ------------------------------------------------------------------------------

    async def load_adapter(self, name: str, weights: AdapterWeights, *, transfer: str, spill_dir: str | None = None, upsert: bool = False) -> None:
        """Load `weights` under `name`. transfer='tensors' sends them in the request; 'disk' sends a folder path."""
        extra = {"upsert": True} if upsert else {}
        if transfer == "tensors":
            payload = {
                "lora_name": name,
                "config_dict": weights.config,
                "serialized_named_tensors": [weights.wire_payload()] * self.tp_size,
                **extra,
            }
            await self._call("POST", "/load_lora_adapter_from_tensors", json=payload)
        elif transfer == "disk":
            if weights.folder is None and spill_dir is None:
                raise ValueError(f"adapter {name}: weights have no folder and no spill_dir was given for transfer 'disk'")
            # A fresh folder per weights object: a name repeats (native upsert), and the folder of the
            # version it replaces is deleted when that version is discarded (rollout/engines/pool.py).
            folder = weights.ensure_folder(f"{spill_dir}/{name}-{uuid.uuid4().hex[:12]}") if weights.folder is None else weights.folder
            await self._call("POST", "/load_lora_adapter", json={"lora_name": name, "lora_path": folder, **extra})
        else:
            raise ValueError(f"weight transfer must be 'tensors' or 'disk', got {transfer!r}")

    async def unload_adapter(self, name: str) -> None:
        await self._call("POST", "/unload_lora_adapter", json={"lora_name": name})

    async def loaded_adapters(self) -> list[str]:
        """Names of the adapters the server holds (from /v1/models)."""
        body = (await self._call("GET", "/v1/models")).json()
        data = body.get("data", [])
        return sorted(m["id"] for m in data if m.get("parent"))

    # --- server --------------------------------------------------------------------------------

    async def health(self, *, generate: bool = False, timeout_s: float = 10.0) -> bool:
        """True when the server answers /health (or /health_generate, which runs a real generation)."""
        try:
            await self._call("GET", "/health_generate" if generate else "/health", timeout=timeout_s)
            return True
        except EngineError:
            return False

    async def server_info(self) -> dict[str, Any]:
        """The server's GET /get_server_info answer (its arguments and state)."""
        return (await self._call("GET", "/get_server_info")).json()

    async def capabilities(self) -> ServerCapabilities:
        """What this server offers beyond stock SGLang, read from its OpenAPI schema."""
        try:
            schema = (await self._call("GET", "/openapi.json")).json()
        except EngineError as e:
            if e.status == 404:  # schema disabled (DISABLE_OPENAPI_DOC): assume stock SGLang
                return ServerCapabilities()
            raise
        schemas = schema.get("components", {}).get("schemas", {})

        def has(model: str, field: str) -> bool:
            return field in schemas.get(model, {}).get("properties", {})

        return ServerCapabilities(
            prefix_abort=has("AbortReq", "prefix"),
            upsert_from_tensors=has("LoadLoRAAdapterFromTensorsReqInput", "upsert"),
            upsert_from_path=has("LoadLoRAAdapterReqInput", "upsert"),
        )
