"""The commands over the REST API: `lorafleet adapters add|ls|show|runs|rm|abort`, `lorafleet fleet`
(the operator's process list, and the slots Tinker models hold) and `lorafleet smoke`
(`lorafleet tinker ...`: api/cli/tinker_commands.py).

Credentials: `--token` (LORAFLEET_API_TOKEN) is the admin token; `--api-key` (TINKER_API_KEY)
is the same option for a tenant's key, which sees only that tenant's runs. Both are sent as a
bearer token.

Output is a table (rich) or, with --json, the API's JSON as it is. Errors print
the server's message (what was wrong, what is allowed) and exit 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from api.cli.client import ApiError, ApiUnreachable, LorafleetClient

DEFAULT_API_URL = "http://127.0.0.1:8000"

ApiUrl = Annotated[str, typer.Option("--api-url", envvar="LORAFLEET_API_URL", help="Base URL of the lorafleet service.")]
Token = Annotated[str | None, typer.Option(
    "--token", "--api-key", envvar=["LORAFLEET_API_TOKEN", "TINKER_API_KEY"], show_default=False,
    help="The admin token, or a tenant's key (tml-..., sees only that tenant's runs); default: $LORAFLEET_API_TOKEN, "
         "else $TINKER_API_KEY.")]
Timeout = Annotated[float, typer.Option("--timeout", min=0.1, help="Timeout of each request, seconds.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")]

adapters_app = typer.Typer(name="adapters", help="Register, inspect, retire and abort adapter runs.", no_args_is_help=True)


@contextmanager
def api_client(api_url: str, token: str | None, timeout: float) -> Iterator[LorafleetClient]:
    """A client whose API errors end the command with the server's message and exit 1."""
    err = Console(stderr=True)
    try:
        with LorafleetClient(api_url, token, timeout) as client:
            yield client
    except ApiError as e:
        err.print(f"[red]error {e.status} {e.code}[/red]: {e.body.get('detail') if isinstance(e.body, dict) else e.body}", highlight=False)
        if isinstance(e.body, dict) and e.body.get("field"):
            err.print(f"field: {e.body['field']}", highlight=False)
        raise typer.Exit(1) from None
    except ApiUnreachable as e:
        err.print(f"[red]error[/red]: {e}", highlight=False)
        raise typer.Exit(1) from None


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """`key.sub=value` pairs into a nested dict; values are YAML (numbers, bools, lists)."""
    out: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set expects KEY=VALUE (e.g. data.path=/data/x.jsonl), got {item!r}")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise typer.BadParameter(f"--set {key}: {p} is not a section")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _slot_cell(a: dict[str, Any]) -> str:
    """The slot, or where the run waits for one: "queued #2" / "evicted #1" (its queue position)."""
    if a.get("queue_position") is not None:
        return f"{a.get('residency') or 'queued'} #{a['queue_position']}"
    return _fmt(a.get("slot"))


def adapters_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("NAME", "STATE", "SLOT", "VERSION", "STEP", "SAMPLES", "REWARD", "LOSS", "EXPORT / REASON")
    for a in rows:
        total = a.get("total_steps")
        step = f"{a['step']}/{total}" if total is not None else str(a["step"])
        tail = a.get("failure_reason") or a.get("export_path") or ""
        table.add_row(
            a["name"], a["state"], _slot_cell(a), _fmt(a.get("weight_version")), step,
            _fmt(a.get("samples_trained")), _fmt(a.get("last_reward")), _fmt(a.get("last_loss")), tail,
        )
    return table


def _print(data: Any, as_json: bool, table: Any = None) -> None:
    if as_json or table is None:
        typer.echo(json.dumps(data, indent=2))
    else:
        Console().print(table)


@adapters_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Adapter name (letters, digits, . _ -).")],
    config: Annotated[Path | None, typer.Option("--config", "-c", exists=True, dir_okay=False, help="YAML/JSON file with the adapter config.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a config field: KEY=VALUE (dotted keys), repeatable.")] = None,
    api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 30.0, as_json: AsJson = False,
) -> None:
    """Register an adapter run (it starts PENDING)."""
    body: dict[str, Any] = {}
    if config is not None:
        loaded = yaml.safe_load(config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise typer.BadParameter(f"{config} must hold a mapping of config fields", param_hint="--config")
        body = loaded
    body = merge(body, parse_sets(set_ or []))
    with api_client(api_url, token, timeout) as client:
        ref = client.register(name, body)
    _print(ref, as_json, adapters_table([ref]))


@adapters_app.command("ls")
def ls(
    state: Annotated[str | None, typer.Option("--state", help="Only adapters in this state (PENDING, ACTIVE, RETIRING, CLEANUP, COMPLETED, FAILED).")] = None,
    api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False,
) -> None:
    """List adapters (newest run per name)."""
    with api_client(api_url, token, timeout) as client:
        rows = client.list(state.upper() if state else None)
    _print(rows, as_json, adapters_table(rows))


@adapters_app.command("show")
def show(
    name: str,
    metrics: Annotated[bool, typer.Option("--metrics", help="Also show the per-step metrics series.")] = False,
    api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False,
) -> None:
    """One adapter: state, slot, version, progress, export, failure reason."""
    with api_client(api_url, token, timeout) as client:
        ref = client.get(name)
        series = client.metrics(name) if metrics else None
    if as_json:
        _print({**ref, "metrics": series} if series is not None else ref, True)
        return
    console = Console()
    console.print(adapters_table([ref]))
    console.print(f"registration {ref['registration_id']}  slot_version {ref['slot_version']}  checkpoint {ref.get('checkpoint_path') or '-'}", highlight=False)
    if series is not None:
        table = Table("STEP", "SAMPLES", "REWARD", "LOSS", "LR", "STALENESS")
        for s in series["steps"]:
            table.add_row(str(s["step"]), str(s["samples"]), _fmt(s["reward_mean"]), _fmt(s["loss"]), _fmt(s["learning_rate"]), _fmt(s["staleness_mean"]))
        console.print(table)


def runs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table()
    table.add_column("REGISTRATION", no_wrap=True, min_width=32)  # whole: it is what GET /v1/runs/{id} takes
    for title in ("STATE", "STEP", "SAMPLES", "CHECKPOINT", "EXPORT / REASON", "OWNER"):
        table.add_column(title)
    for a in rows:
        total = a.get("total_steps")
        step = f"{a['step']}/{total}" if total is not None else str(a["step"])
        table.add_row(a["registration_id"], a["state"], step, _fmt(a.get("samples_trained")), a.get("checkpoint_path") or "-",
                      a.get("failure_reason") or a.get("export_path") or "", a.get("owner") or "(admin)")
    return table


@adapters_app.command("runs")
def runs(name: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False) -> None:
    """Every run of an adapter name, oldest first (earlier registrations stay reachable)."""
    with api_client(api_url, token, timeout) as client:
        rows = client.runs(name)
    _print(rows, as_json, runs_table(rows))


@adapters_app.command("watch")
def watch_cmd(
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between polls.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print the table once and exit (scripts, pipes).")] = False,
    api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0,
) -> None:
    """A live table of the adapters with reward and loss sparklines (Ctrl-C ends it)."""
    from api.cli.watch import watch

    with api_client(api_url, token, timeout) as client:
        watch(client, interval_s=interval, once=once)


@adapters_app.command("rm")
def rm(name: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False) -> None:
    """Retire gracefully: RETIRING now, COMPLETED with its final export later."""
    with api_client(api_url, token, timeout) as client:
        ref = client.retire(name)
    _print(ref, as_json, adapters_table([ref]))


@adapters_app.command("abort")
def abort(name: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False) -> None:
    """Abort the adapter's in-flight generation (it keeps training)."""
    with api_client(api_url, token, timeout) as client:
        n = client.abort(name)
    if as_json:
        _print({"name": name, "aborted": n}, True)
    else:
        typer.echo(f"{name}: aborted {n} in-flight request(s)")


def fleet(api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 30.0, as_json: AsJson = False) -> None:
    """The service's processes, their ids and nodes: coordinator, trainer ranks, rollout worker, engines (GET /v1/fleet)."""
    with api_client(api_url, token, timeout) as client:
        view = client.fleet_view()
    procs = view["processes"]
    table = Table("NAME", "ROLE", "PID", "NODE", "ADDRESS", "DETAIL")
    for p in procs:
        table.add_row(p["name"], p["role"], _fmt(p["pid"]), (p.get("node_id") or "")[:12], p.get("node_ip") or "",
                      p.get("detail") or "")
    _print(procs, as_json, table)  # --json: the processes (the Tinker part: `lorafleet tinker ls --json`, GET /v1/fleet)
    if view.get("tinker") is not None and not as_json:
        Console().print(tinker_fleet_table(view["tinker"]))


def tinker_fleet_table(tinker: dict[str, Any]) -> Table:
    """`lorafleet fleet`'s Tinker part: the slots the models hold, and how many are where (`lorafleet tinker ls`: each)."""
    r = tinker["residency"]
    table = Table("SLOT", "MODEL", "TENANT", title=f"Tinker models: {tinker['models']} ({r.get('resident', 0)} resident, "
                  f"{r.get('queued', 0)} queued, {r.get('evicted', 0)} evicted; {tinker['waiting_for_slot']} waiting for a slot)")
    for s in tinker["slots"]:
        table.add_row(str(s["slot"]), s["model_id"], s["owner"])
    return table


def smoke(
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps the test adapter must reach.")] = 3,
    name: Annotated[str | None, typer.Option("--name", help="Test adapter name (default smoke-<random>).")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", exists=True, dir_okay=False, help="Adapter config file for the test adapter.")] = None,
    data: Annotated[str | None, typer.Option("--data", help="Server-side RL prompt file (default: the tiny world's digits.jsonl on this machine).")] = None,
    timeout: Timeout = 10.0,
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for /ready.")] = 60.0,
    train_timeout: Annotated[float, typer.Option(help="Seconds to wait for the steps.")] = 600.0,
    stall: Annotated[float, typer.Option(help="Fail when no new step comes for this many seconds.")] = 180.0,
    complete_timeout: Annotated[float, typer.Option(help="Seconds to wait for COMPLETED after retiring.")] = 300.0,
    poll: Annotated[float, typer.Option(min=0.05, help="Polling interval, seconds.")] = 1.0,
    as_json: AsJson = False,
) -> None:
    """End-to-end check of a running service (test adapter: register, train, metrics, retire, export)."""
    from api.cli.smoke import SmokeOptions, run_smoke

    cfg = None
    if config is not None:
        cfg = yaml.safe_load(config.read_text())
        if not isinstance(cfg, dict):
            raise typer.BadParameter(f"{config} must hold a mapping of config fields", param_hint="--config")
    opts = SmokeOptions(
        api_url=api_url, token=token, steps=steps, name=name, config=cfg, data=data, request_timeout_s=timeout,
        ready_timeout_s=ready_timeout, train_timeout_s=train_timeout, stall_s=stall,
        complete_timeout_s=complete_timeout, poll_s=poll,
    )
    report = run_smoke(opts)
    if as_json:
        typer.echo(json.dumps({"ok": report.ok, "adapter": report.adapter, "checks": [c.__dict__ for c in report.checks]}, indent=2))
    else:
        Console(stderr=not report.ok).print(report.table())
        failed = next((c for c in report.checks if not c.ok), None)
        if failed is not None:
            Console(stderr=True).print(f"[red]smoke FAILED at {failed.name}[/red]: {failed.detail}", highlight=False)
    raise typer.Exit(0 if report.ok else 1)
