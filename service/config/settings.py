"""The service's own settings: `ServiceSettings`, from the environment (prefix `LORAFLEET_`), an
optional YAML settings file, or explicit values (`load_settings`, with the documented precedence);
the API token rule off loopback; `ConfigError` and how validation errors are printed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from service.config.quotas import Quotas

def _split_list(value: Any) -> Any:
    # Environment values: a JSON list, or entries separated by os.pathsep / commas.
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [p for p in re.split(rf"[{re.escape(os.pathsep)},]", text) if p]
    return value


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MIN_TOKEN_CHARS_OFF_LOOPBACK = 16


def api_token_problem(host: str, token: str | None) -> str | None:
    """Why `token` cannot protect an API bound to `host`, or None. A token that is set must not be
    blank; off loopback one is required, of at least MIN_TOKEN_CHARS_OFF_LOOPBACK characters
    (whitespace around it does not count: it is stripped)."""
    if token is not None and not token.strip():
        return "api_token is blank (only whitespace); set a real token or leave it unset"
    if is_loopback_host(host):
        return None
    if token is None:
        return (f"host {host!r} is not a loopback address, so an API token is required: set LORAFLEET_API_TOKEN "
                f"(or api_token in the settings file) to at least {MIN_TOKEN_CHARS_OFF_LOOPBACK} characters, or bind to 127.0.0.1")
    if len(token.strip()) < MIN_TOKEN_CHARS_OFF_LOOPBACK:
        return (f"host {host!r} is not a loopback address and the API token has only {len(token.strip())} characters; "
                f"use at least {MIN_TOKEN_CHARS_OFF_LOOPBACK} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), "
                "or bind to 127.0.0.1")
    return None


class ServiceSettings(BaseSettings):
    """Settings of the running service. Sources, highest first: explicit values,
    environment (LORAFLEET_*), the settings file (LORAFLEET_SETTINGS_FILE), defaults."""

    model_config = SettingsConfigDict(env_prefix="LORAFLEET_", extra="forbid", frozen=True, allow_inf_nan=False)

    api_token: SecretStr | None = Field(None, description="Bearer token clients must send (surrounding whitespace stripped); required when host is not a loopback address, and then at least 16 characters.")
    host: str = Field("127.0.0.1", description="Address the REST API binds to.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of the REST API (0 = any free port).")
    state_dir: Path = Field(Path("runs/service"), description="Folder for the registry database, checkpoints and exports.")
    storage: str | None = Field(None, description="Where checkpoints, exports and Tinker checkpoints are kept (the one storage layer, trainer/storage/): null = the state dir; a local folder; or s3://bucket/prefix (S3-compatible object storage; endpoint, region and credentials from the standard AWS variables of each node's environment). The coordinator and every trainer node must reach it; checked at start.")
    storage_cache: Path | None = Field(None, description="With s3:// storage: the local folder for this node's verified copies of what it reads and its staging folders (the default: <TMPDIR>/lorafleet-store-cache-<uid>). The coordinator exports it to the processes it starts on its own node; other nodes read LORAFLEET_STORAGE_CACHE from their own environment.")
    export_destinations: dict[str, list[str]] = Field(default_factory=dict, description="Where a run's final export may also be copied (an adapter config's export_to): tenant name (as in the keys file) -> locations (s3://bucket/prefix, or an absolute local folder) below which that tenant's runs may name a folder; '*' lists locations every tenant may use; the admin may use any listed location. Empty: export_to is refused. Object storage is reached with the service's AWS variables. Environment: LORAFLEET_EXPORT_DESTINATIONS as JSON.")
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd()], description="Folders that adapter data, init_from and resume_from must lie in (state_dir is also allowed for init_from/resume_from).")
    reward_import_roots: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Python package prefixes custom reward functions may be imported from (e.g. 'myorg.rewards'); builtin rewards are always allowed.")
    rollout_import_roots: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Python package prefixes custom rollouts (environment classes, async rollout functions; an adapter's config.rollout) may be imported from (e.g. 'myorg.envs'); the built-in single_turn is always allowed.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body the API accepts (bytes); larger ones get 413.")
    # Length limits of every adapter's rows (issue 14: one tenant's long rows must not stall the fleet).
    max_row_bytes: int = Field(1 << 20, ge=1024, description="Longest line of a data file (bytes); longer lines are skipped and counted, never loaded.")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest prompt (tokens, after the chat template); longer rows are skipped and counted.")
    max_completion_tokens: int = Field(8192, ge=1, description="Longest completion (tokens): SFT rows with a longer one are skipped; an rl sampling.max_new_tokens above it is refused.")
    max_step_tokens: int = Field(1 << 21, ge=1, description="Per-step token budget of one adapter: samples per step x the longest sample it may have (prompt + completion limits, the model's context) must not exceed it, checked at registration; bounds what one tenant adds to a mixed train call.")
    data_check_bytes: int = Field(64 << 20, ge=1024, description="Registration reads at most this many bytes of a data file to check its rows (a bounded prefix).")
    data_check_s: float = Field(10.0, gt=0, description="Registration spends at most this many seconds checking a data file; rows beyond are counted from the file size.")
    controller_timeout_s: float = Field(30.0, gt=0, description="Timeout of one API -> controller call (seconds).")
    quotas: Quotas = Field(default_factory=Quotas, description="Per-tenant quotas: live and queued runs per tenant key (429 beyond), a share of trained tokens, a priority (service/config/quotas.py).")
    metrics_adapter_series: Literal["none", "top", "all"] = Field("top", description="Per-adapter series of /metrics: none, the metrics_top_k adapters updated most recently (top: a step or a state change), or every adapter (all: one series per adapter name ever registered).")
    metrics_top_k: int = Field(20, ge=1, le=10_000, description="With metrics_adapter_series 'top': how many adapters get per-adapter series.")
    read_cache_s: float = Field(1.0, ge=0, le=60, description="GET /v1/adapters, /metrics and /v1/fleet/stats: concurrent identical requests share one answer, and requests within this many seconds of it get the same answer (steps and states the loop changes show within it; the caller's own writes at once). 0 = share only among concurrent requests.")
    read_stale_s: float = Field(2.0, ge=0, le=60, description="GET /v1/adapters, /metrics and /v1/fleet/stats: an answer older than read_cache_s, but by at most this many seconds more, is sent at once while one new answer is built in the background (a burst of readers waits for no build; what the loop changes shows within read_cache_s + read_stale_s). 0 = always wait for the new answer.")
    api_front: bool = Field(True, description="Serve the API through a front process of its own (api/front/read_front.py) that answers the polled reads (GET /v1/adapters, /metrics, /v1/fleet/stats) from its cache and passes every other request to the coordinator, so reads never take the training loop's interpreter. False: the coordinator serves host:port itself.")
    settings_file: Path | None = Field(None, description="YAML file with any of these settings (lower priority than the environment).")
    # The Tinker API (docs/tinker.md): served under /api/v1 only when a keys file is given.
    tinker_keys_file: Path | None = Field(None, description="YAML file of 'tenant: key' lines (keys start with 'tml-'); when set, the service also serves the Tinker API under /api/v1.")
    tinker_window_ms: float = Field(20.0, ge=0, le=10_000, description="Tinker: pending forward_backward calls of different models arriving within this window run as one mixed pass (milliseconds); a round whose every resident tenant is ready runs at once.")
    tinker_session_timeout_s: float = Field(300.0, gt=0, description="Tinker: a session without a heartbeat for this long has its models saved and their trainer slots freed (seconds).")
    tinker_max_seq_len: int = Field(4096, ge=1, description="Tinker: longest model_input of one datum (tokens); longer ones are refused in the future's result.")
    tinker_tokenizer_id: str | None = Field(None, description="Tinker: the tokenizer id get_info tells clients (the SDK's get_tokenizer loads it with AutoTokenizer), e.g. the base model's Hugging Face hub id. Default: base_model.served_name when the job file sets it, else the base model's folder, which responses show cut to its last part (server paths are never shown), so clients off this machine need this set.")
    tinker_durability: str = Field("interval:300", description="Tinker: what survives a crash (service/tenants/tinker_durability.py): 'step' = every optim_step is acknowledged only after the model's state is durable and every call is logged, so nothing acknowledged is lost; 'interval:<seconds>' = each changed model is snapshotted at most that often, a crash loses what ran since (its calls are then answered with the step it was restored to). A graceful stop loses nothing either way. Environment: LORAFLEET_TINKER_DURABILITY.")
    tinker_default_seed: int | None = Field(None, ge=0, le=2**31 - 1, description="Tinker: the LoRA init seed of a model whose client gives none (the cookbook's recipes give none); null = a fresh random seed per model, as Tinker does. Set it to make such runs repeatable.")
    tinker_result_ttl_s: float = Field(3600.0, gt=0, description="Tinker: how long a finished call's result is kept for a client that polls again (also across a restart), seconds.")
    tinker_max_body_bytes: int = Field(64 << 20, ge=8 << 20, description="Largest request body of the Tinker API's data-carrying routes (forward, forward_backward); at least 8 MiB.")

    _split = field_validator("data_roots", "reward_import_roots", "rollout_import_roots", mode="before")(lambda cls, v: _split_list(v))

    @field_validator("export_destinations")
    @classmethod
    def _export_locations(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for who, locations in v.items():
            for loc in locations:
                plain = loc.startswith("s3://") and all(p not in ("", ".", "..") for p in loc[5:].rstrip("/").split("/"))
                if not (plain or (Path(loc).is_absolute() and ".." not in Path(loc).parts and "://" not in loc)):
                    raise ValueError(f"export_destinations[{who!r}]: {loc!r} is not a location: an s3://bucket/prefix "
                                     "URL of named parts, or an absolute local folder without '..'")
        return {who: [loc.rstrip("/") for loc in locations] for who, locations in v.items()}

    @field_validator("api_token", mode="after")
    @classmethod
    def _strip_token(cls, token: SecretStr | None) -> SecretStr | None:
        # Clients send the token in a header, where surrounding whitespace does not survive.
        return None if token is None else SecretStr(token.get_secret_value().strip())

    @model_validator(mode="after")
    def _token_off_loopback(self) -> ServiceSettings:
        problem = api_token_problem(self.host, self.api_token.get_secret_value() if self.api_token is not None else None)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def db_path(self) -> Path:
        return self.state_dir / "registry.sqlite3"

    @field_validator("tinker_durability")
    @classmethod
    def _durability(cls, v: str) -> str:
        from service.config.durability import Durability

        Durability.parse(v)  # ValueError saying what is allowed
        return v

    @property
    def storage_location(self) -> str:
        """The store's location (trainer/storage/store.py open_store): `storage`, else the state dir, absolute."""
        return self.storage if self.storage is not None else str(self.state_dir.absolute())

    @property
    def tinker_dir(self) -> Path:
        """Tinker checkpoints (save_state, save_weights_for_sampler), one folder per tenant below."""
        return self.state_dir / "tinker"


class ConfigError(ValueError):
    """A job or settings file that does not validate; the message lists every bad field."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        got = "" if e["type"] in ("missing", "model_type") else f" (got {e.get('input')!r})"
        lines.append(f"{loc or '<root>'}: {e['msg']}{got}")
    return "\n".join(lines)


def load_settings(settings_file: Path | None = None, *, base: dict[str, Any] | None = None, **explicit: Any) -> ServiceSettings:
    """Settings with the documented precedence: explicit > environment > file > base > defaults.

    The file is `settings_file`, else $LORAFLEET_SETTINGS_FILE, else none; `base`
    is a job file's `service:` section."""
    # Raw environment values (validated below, together with everything else).
    env_values = EnvSettingsSource(ServiceSettings, env_prefix="LORAFLEET_")()
    path = settings_file or explicit.get("settings_file") or env_values.get("settings_file")
    file_values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read settings file {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"settings file {path}: expected a mapping of setting names to values, got {type(loaded).__name__}")
        file_values = loaded
    # The final constructor call would read the environment again with lower
    # priority than its arguments, so pass the environment explicitly.
    try:
        return ServiceSettings(**{**(base or {}), **file_values, **env_values, **explicit, "settings_file": path})
    except ValidationError as e:
        raise ConfigError(f"invalid service settings:\n{format_validation_error(e)}") from None
