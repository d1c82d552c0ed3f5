"""The service's commands of the `lorafleet` command line (typer): `run JOB.yaml` (batch mode),
`serve` (service mode), `version`.

`add_service_commands(app, start_api=...)` puts them on the `lorafleet` app, which api/cli/main.py
assembles together with the tenant commands (`adapters ...`, `smoke`, over REST) and to which it
passes the API starter: service/ never imports api/.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # the command modules import the heavy parts (Ray, torch) only when they run
    from service.fleet.startup import ApiStarter


def version() -> None:
    """Print the lorafleet version."""
    from importlib.metadata import version as _v

    typer.echo(f"lorafleet {_v('lorafleet')}")


TINY_JOB = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "job.yaml"

JobArg = Annotated[Path | None, typer.Argument(help="Job YAML file (default: the embedded tiny CPU job, examples/tiny/job.yaml).", show_default=False)]
StateDir = Annotated[Path | None, typer.Option("--state-dir", help="Registry, checkpoints and exports (default: the job's service.state_dir, else $LORAFLEET_STATE_DIR, else runs/service).", show_default=False)]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log the loop's events to stderr.")]


def _load(job_path: Path | None, state_dir: Path | None, **explicit: Any):
    """The validated job and settings; the embedded tiny job builds its world first and
    allows its data folder as a data root wherever it is run from."""
    from service.config.job import load_job
    from service.config.settings import ConfigError

    if job_path is None:
        from examples.tiny.build import ensure_tiny_world

        tiny = ensure_tiny_world()
        job_path = TINY_JOB
        explicit.setdefault("data_roots", [Path(tiny) / "data", Path.cwd()])
    if state_dir is not None:
        explicit["state_dir"] = state_dir
    try:
        job = load_job(job_path)
        settings = job.service_settings(**explicit)
        # Absolute: the registry records checkpoint and export paths under it, and Ray's
        # worker processes must not depend on this process's working directory.
        return job, settings.model_copy(update={"state_dir": settings.state_dir.absolute()})
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@contextmanager
def _clear_errors() -> Iterator[None]:
    """Errors an operator can fix (a refused job adapter, a plan that does not fit, an engine
    that does not start, a registry another service holds, a Ray cluster that cannot be joined) end the command with their
    message and exit 2 instead of a traceback."""
    from rollout.engines.engine import EngineStartError
    from service.fleet.startup import StateDirBusy
    from service.errors import LorafleetError
    from service.errors import PlacementError
    from service.fleet.ray_connect import RayConnectError

    try:
        yield
    except (LorafleetError, PlacementError, EngineStartError, StateDirBusy, RayConnectError) as e:
        typer.echo(f"error: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(2) from None


def _logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def add_service_commands(app: typer.Typer, *, start_api: ApiStarter) -> None:
    """Register `version`, `run` and `serve` on `app`; `serve` starts the REST API with `start_api`."""
    app.command()(version)

    @app.command()
    def run(
        job: JobArg = None,
        state_dir: StateDir = None,
        resume: Annotated[bool, typer.Option("--resume", help="Skip adapters that already COMPLETED in this state dir (finish a killed job).")] = False,
        serve_ui: Annotated[bool, typer.Option("--serve-ui", help="Also serve the REST API and the dashboard (/ui) while the job runs (the service's host and port); prints the address.")] = False,
        verbose: Verbose = False,
    ) -> None:
        """Batch mode: register the job's adapters, train until every adapter is exhausted, print a summary, exit.

        Exit status: 0 every adapter COMPLETED; 1 one FAILED; 130 stopped by Ctrl-C / SIGTERM (checkpointed: --resume continues)."""
        from rich.console import Console

        from service.modes import print_summary, run_batch

        _logging(verbose)
        job_cfg, settings = _load(job, state_dir)
        with _clear_errors():
            result = run_batch(job_cfg, settings, resume=resume, start_api=start_api if serve_ui else None)
        print_summary(Console(), result)
        raise typer.Exit(result.exit_code)

    @app.command()
    def serve(
        job: JobArg = None,
        state_dir: StateDir = None,
        host: Annotated[str | None, typer.Option("--host", help="Bind address of the REST API (default 127.0.0.1; others need a token).", show_default=False)] = None,
        port: Annotated[int | None, typer.Option("--port", help="REST API port (default 8000; 0 = any free port).", show_default=False)] = None,
        verbose: Verbose = False,
    ) -> None:
        """Service mode: start engines, trainer, controller and the REST API; train what tenants register until stopped.

        The job file's adapters (if any) are registered at start; Ctrl-C or SIGTERM drains (every live adapter is
        checkpointed) and exits 0. A restart over the same state dir continues every live adapter."""
        from service.modes import run_service

        _logging(verbose)
        explicit = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        job_cfg, settings = _load(job, state_dir, **explicit)
        with _clear_errors():
            report = run_service(job_cfg, settings, start_api=start_api)
        typer.echo(f"stopped ({report.stopped_by or 'done'}); {report.steps} adapter steps trained", err=True)
