"""The `lorafleet` command line (typer).

Sub-commands: `run JOB.yaml` (batch mode), `serve` (service mode), `version`;
the control-plane commands (`adapters ...`, `smoke`) are added beside them.
"""

from __future__ import annotations

from pathlib import Path

import typer

from service.cli_tenant import adapters_app, smoke

app = typer.Typer(name="lorafleet", help="Train many LoRA adapters at once against one frozen base model.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
app.command("smoke")(smoke)


@app.command()
def version() -> None:
    """Print the lorafleet version."""
    from importlib.metadata import version as _v

    typer.echo(f"lorafleet {_v('lorafleet')}")


@app.command()
def run(job: Path = typer.Argument(None, help="job YAML file (default: the embedded tiny CPU job)")) -> None:
    """Batch mode: register the job's adapters, train until every adapter is exhausted, exit."""
    typer.echo("lorafleet run: not yet implemented (the service issue delivers batch mode)", err=True)
    raise typer.Exit(2)


if __name__ == "__main__":
    app()
