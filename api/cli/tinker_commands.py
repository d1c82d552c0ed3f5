"""`lorafleet tinker ls|show`: the Tinker models beside the runs (GET /v1/tinker/models), as tables.

The same credentials as `lorafleet adapters` (api/cli/tenant_commands.py): the admin token sees every
tenant's models (`--owner` picks one tenant's), a tenant's key only its own. A model's state is
where it is: `slot k` (resident), `queued #n` / `evicted #n` (waiting for a slot, n its place in
the scheduler's one queue), `evicted (host|disk|store)` (out of its slot with nothing to run). The
loss column is its last forward_backward's loss:sum, with a sparkline of its per-step curve.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from api.cli.tenant_commands import DEFAULT_API_URL, ApiUrl, AsJson, Timeout, Token, _fmt, _print, api_client
from api.cli.watch import sparkline

tinker_app = typer.Typer(name="tinker", help="The Tinker models: where each is, its tenant, what it trained and sampled.",
                         no_args_is_help=True)


def where_cell(m: dict[str, Any]) -> str:
    """A model's state as a cell (module doc)."""
    if m["slot"] is not None:
        return f"slot {m['slot']}"
    if m.get("queue_position") is not None:
        return f"{m['residency']} #{m['queue_position']}"
    return f"evicted ({m['where']})" if m["residency"] == "evicted" else m["residency"]


def models_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("MODEL", "TENANT", "STATE", "STEP", "TOKENS", "LOSS", "CURVE", "SAMPLES", "RANK")
    for m in rows:
        table.add_row(m["model_id"], m["owner"], where_cell(m), str(m["step"]), str(m["tokens_trained"]), _fmt(m["last_loss"]),
                      sparkline([p["loss"] for p in m["loss_curve"]], 16), str(m["sample_calls"]), str(m["rank"]))
    return table


@tinker_app.command("ls")
def ls(
    state: Annotated[str | None, typer.Option("--state", help="Only models in this state: resident, queued, evicted.")] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="The admin only: only this tenant's models.")] = None,
    q: Annotated[str | None, typer.Option("--q", help="Only models whose id contains this (case-insensitive).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, max=1000, help="One page of at most this many (default: every model).")] = None,
    offset: Annotated[int, typer.Option("--offset", min=0, help="With --limit: skip this many.")] = 0,
    api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0, as_json: AsJson = False,
) -> None:
    """List the live Tinker models (oldest first)."""
    filters = {k: v for k, v in (("state", state), ("owner", owner), ("q", q)) if v is not None}
    with api_client(api_url, token, timeout) as client:
        if limit is None:
            rows = client.tinker_models(**filters)
            total = len(rows)
        else:
            page = client.tinker_models_page(limit=limit, offset=offset, **filters)
            rows, total = page["models"], page["total"]
    if as_json:
        _print(rows, True)
        return
    Console().print(models_table(rows))
    if limit is not None and offset + len(rows) < total:
        typer.echo(f"{offset + 1}-{offset + len(rows)} of {total}: --offset {offset + len(rows)} for more")


@tinker_app.command("show")
def show(model_id: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None, timeout: Timeout = 10.0,
         as_json: AsJson = False) -> None:
    """One model: its state, what it did, and its loss per step."""
    with api_client(api_url, token, timeout) as client:
        m = client.tinker_model(model_id)
    if as_json:
        _print(m, True)
        return
    console = Console()
    console.print(models_table([m]))
    console.print(f"session {m['session_id']}  forward_backward calls {m['forward_backward_calls']}  sampled sequences "
                  f"{m['sampled_sequences']}  admissions {m['admissions']}  waited {_fmt(m['waited_grants'])} slot grant(s)",
                  highlight=False)
    if m.get("waiting_reason"):
        console.print(f"waiting: {m['waiting_reason']}", highlight=False)
    table = Table("STEP", "LOSS")
    for p in m["loss_curve"]:
        table.add_row(str(p["step"]), _fmt(p["loss"]))
    console.print(table)

