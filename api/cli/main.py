"""The `lorafleet` entry point: the service's commands (service/cli.py: `run`, `serve`, `version`)
and the commands over REST (api/cli/tenant_commands.py: `adapters ...`, `fleet`, `smoke`;
api/cli/tinker_commands.py: `tinker ...`) on one typer app.

It sits above both packages: here the service is handed the API starter
(api.server.start_api_server), so service/ never imports api/.
Run it as `lorafleet ...` (console script) or `python -m api.cli.main ...`.
"""

from __future__ import annotations

import typer

from api.cli.tenant_commands import adapters_app, fleet, smoke
from api.cli.tinker_commands import tinker_app
from api.server import start_api_server
from service.cli import add_service_commands

app = typer.Typer(name="lorafleet", help="Train many LoRA adapters at once against one frozen base model.", no_args_is_help=True)
add_service_commands(app, start_api=start_api_server)
app.add_typer(adapters_app, name="adapters")
app.add_typer(tinker_app, name="tinker")
app.command("fleet")(fleet)
app.command("smoke")(smoke)

if __name__ == "__main__":
    app()
