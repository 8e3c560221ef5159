"""`agentrl env list` and `agentrl env check ID`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="List registered environments and check them against the AgentEnv contract.",
        no_args_is_help=True,
    )

    @group.command("list")
    def list_command() -> None:
        """Every registered env id (built in, registered, or installed through entry points)."""
        from rich.console import Console
        from rich.table import Table

        from agentrl.envs import EnvLoadError, list_envs, spec

        table = Table(title="agentrl environments")
        table.add_column("id", no_wrap=True)
        table.add_column("entry point", overflow="fold")
        table.add_column("description")
        for env_id in list_envs():
            try:
                s = spec(env_id)
            except EnvLoadError as e:
                table.add_row(env_id, "?", f"[red]failed to load: {e}[/red]")
                continue
            entry_point = (
                s.entry_point
                if isinstance(s.entry_point, str)
                else f"{s.entry_point.__module__}:{s.entry_point.__qualname__}"
            )
            table.add_row(env_id, entry_point, s.description)
        Console().print(table)

    @group.command("check")
    def check_command(
        env_id: str = typer.Argument(..., help="A registered env id (see `agentrl env list`)"),
        seed: int = typer.Option(0, help="Seed for the reset/seeding checks"),
    ) -> None:
        """Drive the env through reset/step/close without a model; exit 1 listing each problem."""
        from rich.console import Console

        from agentrl.envs import EnvCheckError, check_env

        console = Console()
        try:
            check_env(env_id, seed=seed)
        except EnvCheckError as e:
            console.print(f"[red]✗ {env_id}: {len(e.problems)} problem(s)[/red]")
            for problem in e.problems:
                console.print(f"  - {problem}", markup=False, highlight=False)
            raise typer.Exit(code=1)
        console.print(f"[green]✓ {env_id} passes check_env[/green]")

    @group.command("serve")
    def serve_command(
        env_id: str = typer.Argument(..., help="A registered env id, or module:Class"),
        host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)"),
        port: int = typer.Option(8100, help="TCP port"),
        kwargs: str = typer.Option("{}", help="Env constructor kwargs as JSON: '{\"a\": 1}'"),
        max_sessions: int = typer.Option(64, help="Most live sessions (episodes)"),
        session_ttl_s: float = typer.Option(
            600.0, help="An idle session is closed after this many seconds"
        ),
    ) -> None:
        """Serve the env over HTTP, one session per episode; train or evaluate against it with
        `--env agentrl.envs.remote:RemoteEnv --set env.kwargs.url=http://HOST:PORT`."""
        import json

        from agentrl.envs.server import serve_env

        try:
            env_kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"--kwargs {kwargs!r} is not JSON: {e}") from e
        if not isinstance(env_kwargs, dict):
            raise typer.BadParameter(f"--kwargs {kwargs!r}: give a JSON object")
        url = f"http://{host}:{port}"
        typer.echo(
            f"serving env {env_id} on {url}; train or evaluate against it with "
            f"--env agentrl.envs.remote:RemoteEnv --set env.kwargs.url={url}",
            err=True,
        )
        serve_env(
            env_id,
            host=host,
            port=port,
            env_kwargs=env_kwargs,
            max_sessions=max_sessions,
            session_ttl_s=session_ttl_s,
        )

    app.add_typer(group, name="env")
